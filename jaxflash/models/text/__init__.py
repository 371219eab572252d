"""Text in and out: the tokenizer, its files, chat templates and stop tokens."""
