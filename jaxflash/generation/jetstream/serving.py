"""Serve a ``LlamaEngine`` through JetStream's own orchestrator and gRPC server.

The Driver gets the engine through ``api.EngineApi`` (JetStream's Engine API over it,
with the adapter's own state) behind ``adapter.JetStreamEngine`` (the only module
besides this one and ``compat`` that imports JetStream).

``serve(engine, params, tokenizer=..., port=...)`` builds JetStream's ``orchestrator.Driver``
(interleaved mode: one engine does prefill and generate, as ``server_lib.run``
sets up for ``interleaved_slices``) and wraps it in ``server_lib.JetStreamServer``
— JetStream's gRPC ``Orchestrator`` service (``Decode`` streaming, ``HealthCheck``).
A trained model is served this way; ``decode_text`` is a small client.

Why RL rollouts do not use the Driver (they use ``slot_loop.SlotBatcher``):

- **Params are fixed at start.** The Driver's generate thread reads its params
  once; new learner weights would mean tearing the server down. The engine
  takes params on every call (``generate_block``), which the slot loop uses to
  swap weights between steps with no recompilation.
- **No abort.** A request runs until EOS or ``max_tokens``; there is no call to
  drop a stale or surplus sample (the async-ratio bound needs one).
- **No logprobs, versions or sampling parameters.** The gRPC API streams text
  / token ids only: no behaviour logprobs, no per-token policy version, no
  temperature / top-k / top-p or RNG identity per request (the engine's static
  sampling applies, and requests get RNG ids from a per-API counter).
- It also discards the token ``prefill`` samples (``EngineApi`` works around it by
  emitting that token on the slot's first ``generate``), and a Python exception
  in any Driver thread SIGKILLs the process (so over-long prompts are truncated
  by the tokenizer adapter, as JetStream itself does, instead of raising).

JetStream 0.2.2 needs ``compat.import_orchestrator()`` first (the
removed ``jax.tree_map``); ``serve`` does it.

Address: JetStream 0.2.2's ``server_lib.JetStreamServer`` binds the hard-coded
host ``[::]`` (every interface, IPv4 and IPv6) with whatever credentials it is
given — insecure ones in its own ``run``. ``serve`` binds loopback
(``127.0.0.1``) by default instead, through a subclass that re-does only the
constructor with the host as a parameter (the rest of JetStream's server is
inherited unchanged; re-check the constructor when upgrading JetStream).
Exposing the server is explicit: ``host="0.0.0.0"`` (or ``"[::]"``), still
without TLS or authentication, so only on a trusted network.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
from concurrent import futures
from typing import Any

import grpc

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.jetstream.adapter import JetStreamEngine
from jaxflash.generation.jetstream.api import EngineApi
from jaxflash.generation.jetstream.compat import import_orchestrator

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, release)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host.strip("[]"), 0))
        return int(sock.getsockname()[1])


def _grpc_target(host: str, port: int) -> str:
    """ "host:port" for gRPC, IPv6 hosts in brackets ("[::1]:9000")."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def _bound_server_class(server_lib: Any) -> type:
    """JetStream's server with the bind host as a parameter (its own is ``[::]``)."""
    from jetstream.core.proto import jetstream_pb2_grpc  # noqa: PLC0415

    class BoundJetStreamServer(server_lib.JetStreamServer):
        # Same as JetStreamServer.__init__ (JetStream 0.2.2) except the bind address.
        def __init__(self, driver: Any, threads: int, host: str, port: int, credentials: Any):
            self._executor = futures.ThreadPoolExecutor(max_workers=threads)
            self._loop = asyncio.new_event_loop()
            self._loop.set_default_executor(self._executor)
            self._loop_thread = threading.Thread(target=self._loop.run_forever)
            self._loop_thread.start()

            async def do_init():
                self._grpc_server = grpc.aio.server(self._executor)

            asyncio.run_coroutine_threadsafe(do_init(), loop=self._loop).result()
            self._driver = driver
            jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
                server_lib.orchestrator.LLMOrchestrator(driver=self._driver), self._grpc_server
            )
            target = _grpc_target(host, port)
            try:
                bound = self._grpc_server.add_secure_port(target, credentials)
            except RuntimeError:  # grpc raises where older versions returned 0
                bound = 0
            if bound == 0:
                self.stop_loop()
                raise OSError(f"JetStreamService: cannot bind {target}")

        def stop_loop(self) -> None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join()

    return BoundJetStreamServer


class JetStreamService:
    """A running Driver + gRPC server; stop it with ``stop()`` or a ``with`` block.

    Args:
      engine: the engine (dense cache).
      params: model params, fixed for the server's lifetime.
      tokenizer: what the Driver tokenizes text with (``encode``, ``decode``,
        ``eos_id``, ``pad_id``; e.g. ``jaxflash.models.text.tokenizer.Tokenizer``).
      host: interface to bind; loopback by default. "0.0.0.0" / "[::]" expose
        the server to the network (no TLS, no authentication).
      port: TCP port; 0 picks a free one (see ``free_port``).
      threads: gRPC handler threads (at least the number of concurrent requests).

    Attributes:
      host, port: where it listens; address: "host:port" for clients (a
        wildcard host is reached through loopback).

    Raises:
      OSError: the address cannot be bound.
    """

    def __init__(
        self,
        engine: LlamaEngine,
        params: Any,
        *,
        tokenizer: Any,
        host: str = LOOPBACK,
        port: int = 0,
        threads: int = 4,
    ):
        if tokenizer is None:
            raise ValueError("JetStreamService: serving text needs tokenizer=")
        orchestrator = import_orchestrator()
        from jetstream.core import server_lib  # noqa: PLC0415 (after the compat import)

        self.host = host
        wildcard = host.strip("[]") in ("0.0.0.0", "::")
        self.port = port or free_port(LOOPBACK if wildcard else host)
        self.address = _grpc_target(LOOPBACK if wildcard else host, self.port)
        params = engine.place_params(params)
        # JetStream's Engine API over the engine, as the engine_api.Engine the Driver expects.
        adapter = JetStreamEngine(EngineApi(engine, tokenizer=tokenizer))
        self._driver = orchestrator.Driver(
            prefill_engines=[adapter],
            generate_engines=[adapter],
            prefill_params=[params],
            generate_params=[params],
            interleaved_mode=True,
            jax_padding=False,  # our engine copies prompts to host anyway
        )
        try:
            self._server = _bound_server_class(server_lib)(
                self._driver, threads, host, self.port, grpc.insecure_server_credentials()
            )
            self._server.start()
        except BaseException:
            self._driver.stop()
            raise
        self._stopped = False

    def stop(self) -> None:
        """Stop the Driver's threads, the gRPC server, its event loop and its
        handler thread pool (JetStream's own ``stop`` leaves the last running)."""
        if self._stopped:
            return
        self._stopped = True
        server, self._server, self._driver = self._server, None, None
        server.stop()
        server._executor.shutdown(wait=True)  # noqa: SLF001 (no public handle)
        server._loop.close()  # noqa: SLF001
        # grpc.aio runs one process-wide poller thread while any aio server
        # object is alive; it exits once the last one is collected.
        del server
        gc.collect()

    def __enter__(self) -> JetStreamService:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(
    engine: LlamaEngine,
    params: Any,
    *,
    tokenizer: Any,
    host: str = LOOPBACK,
    port: int = 0,
    threads: int = 4,
) -> JetStreamService:
    """Start serving ``engine`` with ``params`` over JetStream's gRPC API.

    See ``JetStreamService`` for arguments (loopback unless ``host`` says
    otherwise). Returns the running service.
    """
    return JetStreamService(
        engine, params, tokenizer=tokenizer, host=host, port=port, threads=threads
    )


def decode_text(address: str, text: str, *, max_tokens: int, timeout_s: float = 120.0) -> str:
    """Send one text request to a JetStream server and return the whole completion.

    Args:
      address: "host:port".
      text: the prompt, tokenized by the server.
      max_tokens: response budget in tokens.
      timeout_s: deadline for the whole streamed call.

    Returns:
      The concatenated streamed text (EOS not included).
    """
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: PLC0415

    request = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text=text), max_tokens=max_tokens
    )
    with grpc.insecure_channel(address) as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        pieces = []
        for response in stub.Decode(request, timeout=timeout_s):
            pieces.extend(s.text for s in response.stream_content.samples)
    return "".join(pieces)
