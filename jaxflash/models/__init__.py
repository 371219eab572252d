"""jaxflash.models: one decoder and what it needs, in rooms by floor.

A room imports only rooms on lower floors:

0 ``config`` (ModelConfig, presets) · ``text`` (tokenizer, chat templates, stop tokens)
1 ``caches`` (the cache face, KV caches, attention paths) · ``adapters`` (LoRA, quantized bases)
2 ``decoder`` (params, the layer stack, one block, RoPE, MLPs, logprobs)
3 ``formats`` (GGUF / Hugging Face import and export, PEFT export)

``tests/test_import_graph.py`` checks the floors.
"""
