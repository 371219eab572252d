"""What rides on the weights: LoRA adapters and int8/NF4 quantized bases."""
