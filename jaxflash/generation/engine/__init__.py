"""The generation engine, one module per thing it holds.

- ``llama_engine``: ``LlamaEngine``, the slot loop's engine (``start_samples`` /
  ``generate_block``); JetStream's Engine API is an adapter over it
  (``generation.jetstream``).
- ``state``: ``EngineConfig`` and the device-state types (``DecodeState``,
  ``PrefillBatch``, ``PromptPrefill``, ``SampleStart``, ``BlockResult``) with their
  shardings.
- ``kernels``: the device programs as pure functions; ``programs``: their jitted,
  trace-counted wrappers.
- ``prefill``: prompt buckets, batched prefill, first tokens (``Prefiller``).
- ``params``: the unstacked param layout on the generation mesh; ``weights``: the
  trees an engine accepts, their placement and LoRA adapters (``EngineWeights``).
- ``host_arrays``: host-side padding and grouping of the programs' inputs.
- ``paging``: a paged engine's slot groups and attention path on its mesh
  (``resolve_paged``).
"""
