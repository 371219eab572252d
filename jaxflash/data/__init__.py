"""jaxflash.data: prompt sources (layer 2).

- `arithmetic.ArithmeticTask`: seeded procedural arithmetic, row(i) deterministic.
- `files.load_rows`: JSONL / Parquet {prompt, answer} rows; `DatasetError`, `RowFailure`.
- `prompts.PromptSource`: rows -> tokenized `types.Prompt` or `PromptFailure`, from a cursor.
"""
