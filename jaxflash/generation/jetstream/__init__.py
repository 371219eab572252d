"""JetStream's Engine API over the slot loop's engine, for serving a trained model.

JetStream is archived upstream: it is an adapter here, used by ``launch/serve.py``
alone and never by training (``google-jetstream`` is the optional ``serve`` extra).

- ``state``: the adapter's device state (``ServeState``: the engine's ``DecodeState``
  plus JetStream's emitted lengths and pending prefill tokens), ``Prefix`` (a
  prefilled prompt, what JetStream's ``insert`` takes) and ``DecodeResult`` (the
  layout of JetStream's ``ResultTokens``).
- ``kernels``: JetStream's ``insert`` and ``generate`` as pure functions, built from
  the engine's own pieces (``generation.engine.kernels``).
- ``api``: ``EngineApi``, JetStream's Engine API in pure JAX over a ``LlamaEngine``
  (``prefill`` / ``insert`` / ``generate``; no JetStream import).
- ``adapter``: ``JetStreamEngine``, ``EngineApi`` behind
  ``jetstream.engine.engine_api.Engine``; ``compat``: the shims JetStream 0.2.2 needs
  and its tokenizer adapter; ``serving``: JetStream's Driver + gRPC server.

Only ``adapter``, ``compat`` and ``serving`` import JetStream (whose ``engine_api``
pulls TensorFlow through seqio).
"""
