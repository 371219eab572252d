"""jaxflash: asynchronous RL post-training for LLMs, native to JAX."""

__version__ = "0.1.0"
