"""A layer's attention through its cache.

The cache face, the dense and paged KV caches, the attention paths and the ragged TPU
kernel.
"""
