"""Weights on disk: GGUF and Hugging Face import, HF export, LoRA export."""
