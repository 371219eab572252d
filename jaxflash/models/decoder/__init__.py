"""The one decoder (Llama, Qwen2/3, Mistral, Gemma 3).

Its params, the layer stack, one block, RoPE, the MLPs and chunked logprobs.
"""
