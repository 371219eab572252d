"""A generation program: its own JAX program serving rollouts to the controller over gRPC.

On a pod each generation slice is a separate JAX program (a multi-controller JAX
job needs all of its hosts, so one job cannot be split between a learner and
generators without Pathways). This module is that program: a gRPC server
(``rpc_wire.SERVICE``, loopback by default, JSON headers + raw arrays, no pickle)
in front of one ``GenerationServer`` thread driving a ``LlamaEngine`` on this
process's devices. The controller talks to it through ``RemoteGenerationServer``
(``runtime.fleet.remote_server``), which fits the scheduler's
``GenerationServerProtocol``. The process that serves it (``python -m
jaxflash.runtime.fleet.gen_process``, or ``launch/tpu_pod.py`` on a pod) is
``gen_process``; over several hosts process 0 serves and the others follow it
(``gen_hosts``).

Calls (each reply carries an ``rpc_wire.Status``):

- ``Configure``: model config, engine config, mesh axes, partial-rollout policy,
  stop ids, transfer method, and under LoRA (``lora``) the adapters' config and the
  base's source. Builds the engine and a ``WeightReceiver`` on its own devices;
  replies with the receiver's layout (JSON), which the learner stages its weights
  for. Under LoRA the program builds the frozen base itself, once (the same file or
  seed, cast / quantized like the learner's), places it, and replies with its
  digest (``base_digest``, checked against the learner's); the layout is then the
  adapters' only, so each pull moves only them. Idempotent for an equal config;
  another is BAD_CONFIG.
- ``Update``: a ``WeightOffer`` (version + the learner processes' sender
  addresses). A puller thread pulls exactly that version (double-buffered: the
  server keeps generating with its installed weights until every block arrived)
  and hands it to the server, which applies it between two decode steps. The
  first install starts the server.
- ``Submit`` / ``Abort`` / ``Stats``: the ``GenerationServer`` calls.
- ``Events`` (server streaming): finished samples, the applied version when it
  changes, installs, failed pulls, heartbeats, and ``down`` when the loop died.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import Any

import grpc

from jaxflash.runtime.fleet import rpc_wire
from jaxflash.runtime.fleet.gen_hosts import build_program, check_host_shards, paired
from jaxflash.runtime.fleet.rpc_wire import Status, WeightOffer, reply

HEARTBEAT_S = 0.5
"""Seconds between heartbeats on the event stream (the controller's liveness signal)."""


class GenerationProgram:
    """The service behind a generation program's gRPC server (thread-safe).

    Args:
      host: interface of this program's jax transfer server (the receiving end
        of weight pulls).
      heartbeat_s: seconds between heartbeat events.

    Over several hosts (``jax.distributed``), this runs in process 0 and drives the
    others through ``attach``'s ``gen_hosts.ProgramHosts``: they build the same engine,
    pull their own shards of every version, and replay the server's loop.
    """

    def __init__(self, *, host: str = "127.0.0.1", heartbeat_s: float = HEARTBEAT_S):
        self._host = host
        self._hosts: Any = None  # gen_hosts.ProgramHosts over several hosts (``attach``)
        self._heartbeat_s = float(heartbeat_s)
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._config: dict[str, Any] | None = None
        self._target: WeightOffer | None = None
        self._installed: int | None = None
        self._moved: dict[int, int] = {}  # the last install's version -> payload bytes
        self._fatal: str | None = None
        self._subscriber = 0
        self._counts: collections.Counter = collections.Counter()
        # Set once by configure (under _cond), read-only afterwards:
        self._built: Any = None  # gen_hosts.Built: engine, receiver, layout, LoRA base
        self._server: Any = None  # GenerationServer, built at the first install
        self._events: queue.Queue = queue.Queue()
        self.stopped = threading.Event()
        self._puller = threading.Thread(target=self._pull_loop, name="gen-puller", daemon=True)

    def attach(self, hosts: Any) -> None:
        """The program's other hosts (``gen_hosts.ProgramHosts``), before any call."""
        self._hosts = hosts

    def host_lost(self, why: str) -> None:
        """Another host died: the program is dead. Say so on the event stream, then exit
        (the controller restarts the whole program; its collectives would hang)."""
        with self._cond:
            self._fatal = why
            self._cond.notify_all()
        threading.Timer(2.0, os._exit, args=(1,)).start()

    # ------------------------------------------------------------ the calls

    def configure(self, header: dict[str, Any]) -> bytes:
        config = {k: header[k] for k in _CONFIG_KEYS if k in header}
        for key in ("lora", "delta"):  # optional: adapters over a base built here; deltas
            if header.get(key):
                config[key] = header[key]
        missing = sorted(set(_CONFIG_KEYS) - set(config))
        if missing:
            return reply(Status.BAD_CONFIG, error=f"Configure is missing {missing}")
        with self._cond:
            if self._config is not None:
                if self._config != config:
                    return reply(
                        Status.BAD_CONFIG,
                        error="this generation program already runs another configuration "
                        f"(differs in {sorted(k for k in config if config[k] != self._config[k])})",
                    )
                return self._configured()
            try:
                self._build(config)
            except Exception as err:  # a config this program cannot run: say why
                return reply(Status.BAD_CONFIG, error=f"{type(err).__name__}: {err}")
            self._config = config
            self._puller.start()
            return self._configured()

    def _configured(self) -> bytes:
        b = self._built
        return reply(Status.OK, layout=b.layout_json, pid=os.getpid(), base_digest=b.base_digest)

    def _build(self, config: dict[str, Any]) -> None:
        if self._hosts is not None:  # the other hosts build theirs meanwhile
            self._hosts.post("configure", config=config)
        self._built = build_program(config, self._host)
        if self._hosts is not None:
            self._hosts.check_configured()

    def update(self, header: dict[str, Any]) -> bytes:
        """Pull ``header["offer"]``; with ``wait``, reply only once it is installed.

        Waiting is what keeps α exact: a request submitted after the reply is started
        at the new version (the server applies the install before its next prefill),
        as with a thread server given new params. DOWN when not installed within
        ``timeout_s`` (failed pulls are retried until then).
        """
        offer = WeightOffer.from_json(header["offer"])
        with self._cond:
            if self._config is None:
                return reply(Status.DOWN, error="not configured")
            if self._target is None or offer.version > self._target.version:
                self._target = offer
                self._cond.notify_all()
            if not header.get("wait"):
                return reply(Status.OK)
            end = time.monotonic() + float(header.get("timeout_s", 120.0))
            while self._installed is None or self._installed < offer.version:
                if self._fatal is not None or self.stopped.is_set():
                    return reply(Status.DOWN, error=self._fatal or "shutting down")
                left = end - time.monotonic()
                if left <= 0:
                    return reply(
                        Status.DOWN, error=f"version {offer.version} not installed in time"
                    )
                self._cond.wait(min(left, 0.5))
            moved = self._moved.get(offer.version)
        return reply(Status.OK, moved=moved)

    def submit(self, message: bytes) -> bytes:
        try:
            request = rpc_wire.decode_request(message)
        except ValueError as err:  # WireError or bad sampling values: this request only
            return reply(Status.REJECTED, error=str(err))
        server = self._live_server()
        if isinstance(server, bytes):
            return server
        try:
            server.submit(request)
        except ValueError as err:
            return reply(Status.REJECTED, error=str(err))
        except Exception as err:
            return reply(Status.DOWN, error=repr(err))
        return reply(Status.OK)

    def abort(self, header: dict[str, Any]) -> bytes:
        server = self._live_server()
        if isinstance(server, bytes):
            return server
        try:
            return reply(Status.OK, aborted=server.abort_prompt(int(header["prompt_id"])))
        except Exception as err:
            return reply(Status.DOWN, error=repr(err))

    def stats(self, header: dict[str, Any]) -> bytes:
        del header
        server = self._live_server()
        if isinstance(server, bytes):
            return server
        try:
            stats = server.stats()
        except Exception as err:
            return reply(Status.DOWN, error=repr(err))
        with self._cond:
            counts = dict(self._counts)
        receiver = self._built.receiver.stats
        hosts = {} if self._hosts is None else self._hosts.pids  # the other hosts' pids
        program = {**counts, "pull_bytes": receiver.bytes, "pid": os.getpid(), "host_pids": hosts}
        return reply(Status.OK, stats=stats, program=program)

    def shutdown(self, header: dict[str, Any]) -> bytes:
        del header
        with self._cond:
            self.stopped.set()
            self._cond.notify_all()
        if self._server is not None:
            try:
                self._server.stop(timeout_s=10)
            except Exception:  # shutting down anyway
                pass
        return reply(Status.OK)

    def events(self, message: bytes, context: grpc.ServicerContext):
        """Server-streaming: one subscriber at a time (a newer one ends the older)."""
        del message
        with self._cond:
            self._subscriber += 1
            me = self._subscriber
        version = None
        beat = 0.0
        yield rpc_wire.encode({"type": "hello", "pid": os.getpid()})
        while not self.stopped.is_set() and context.is_active():
            with self._cond:
                if self._subscriber != me:
                    return
                fatal = self._fatal
            if fatal is not None:
                yield rpc_wire.encode({"type": "down", "error": fatal})
                return
            try:
                header, arrays = self._events.get(timeout=min(0.05, self._heartbeat_s))
                yield rpc_wire.encode(header, arrays)
            except queue.Empty:
                pass
            server = self._server
            if server is not None:
                try:
                    server.check()
                except Exception as err:
                    with self._cond:
                        self._fatal = f"generation loop failed: {err!r}"
                    continue
                if server.version != version:
                    version = server.version
                    yield rpc_wire.encode({"type": "version", "version": int(version)})
            now = time.monotonic()
            if now >= beat:
                beat = now + self._heartbeat_s
                yield rpc_wire.encode({"type": "heartbeat"})

    # ------------------------------------------------------------ the puller thread

    def _live_server(self) -> Any:
        """The server, or a DOWN reply (not configured, no weights yet, or failed)."""
        with self._cond:
            if self._fatal is not None:
                return reply(Status.DOWN, error=self._fatal)
            if self._server is None:
                return reply(Status.DOWN, error="no weights installed yet")
            return self._server

    def _pull_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self.stopped.is_set() and (
                        self._target is None
                        or (self._installed is not None and self._target.version <= self._installed)
                    ):
                        self._cond.wait()
                    if self.stopped.is_set():
                        return
                    offer = self._target
                self._pull(offer)
        except BaseException as err:  # surfaced as "down" on the event stream
            with self._cond:
                self._fatal = f"weight puller failed: {err!r}"

    def _pull(self, offer: WeightOffer) -> None:
        from jaxflash.runtime.fleet.gen_server import GenerationServer  # noqa: PLC0415
        from jaxflash.sync.transfer_digest import tree_digest  # noqa: PLC0415
        from jaxflash.sync.transfer_wire import TransferError, TransferErrorKind  # noqa: PLC0415

        cfg = self._config
        transfer = cfg["transfer"]
        self._events.put(({"type": "pulling", "version": offer.version}, {}))
        t0 = time.perf_counter()
        hosts, replies, shards = self._hosts, None, None
        before = self._built.receiver.stats.bytes
        if hosts is not None:  # every host pulls its own shards, at the same time
            hosts.post("pull", offer=offer.to_json())
        try:
            current = self._built.receiver.current
            if current is None or current.version != offer.version:  # (a retry after a
                current = self._built.receiver.pull(  # host failed: this one has it already)
                    paired(offer.senders, 0),
                    method=transfer["method"],
                    chunk_bytes=int(transfer["chunk_bytes"]),
                    timeout_s=float(transfer["timeout_s"]),
                    version=offer.version,
                )
            if hosts is not None:  # every host has it (and the blocks they share agree)
                replies = hosts.gather("pulled")
                shards = check_host_shards(current.params, replies, bool(cfg["digests"]))
        except TransferError as err:
            if hosts is not None and replies is None:
                hosts.gather("pulled")  # theirs, to keep replies in step (retried anyway)
            with self._cond:
                self._counts[f"pull_failed_{err.kind.value}"] += 1
                # VERSION: the learner moved on; a newer Update follows at once. Others
                # (a learner restarting): retry after a pause, never with mixed weights.
                self._cond.wait(0.2 if err.kind is TransferErrorKind.VERSION else 1.0)
            self._events.put(
                ({"type": "pull_failed", "version": offer.version, "kind": err.kind.value,
                  "error": str(err)}, {})
            )  # fmt: skip
            return
        seconds = time.perf_counter() - t0
        params = current.params  # the model, or under LoRA the adapters over our base
        if self._built.base is not None:
            params = self._built.engine.with_adapters(self._built.base, params)
        if self._server is None:
            if hosts is not None:  # the batcher's set-up runs engine programs: all hosts
                hosts.post("start", version=current.version)
            server = GenerationServer(
                str(cfg["name"]),
                self._built.engine,
                params,
                policy_version=current.version,
                stop_ids=[int(i) for i in cfg["stop_ids"]],
                partial_rollout=str(cfg["partial_rollout"]),
                on_finished=self._on_finished,
                mirror=None if hosts is None else hosts.mirror,
            )
            server.start()
            with self._cond:
                self._server = server
        else:
            self._server.update_weights(params, current.version)
        pulled = self._built.receiver.stats.bytes
        # This version's payload bytes, every host (a delta's, or the full tree's).
        moved = pulled - before + sum(int(r.get("bytes") or 0) for r in (replies or {}).values())
        event = {"type": "installed", "version": current.version, "seconds": seconds,
                 "method": transfer["method"], "bytes": pulled, "moved": moved}  # fmt: skip
        # Under delta publish (a DeltaPuller), process 0's pulls so far by kind (delta,
        # full, fallback_*): in the event and the program's stats.
        pulls = {f"pull_{k}": n for k, n in getattr(self._built.receiver, "counts", {}).items()}
        event.update(pulls)
        if cfg.get("digests") and hosts is None:
            event["digest"] = tree_digest(current.params)
        elif cfg.get("digests"):
            event["shard_digests"] = shards
        with self._cond:
            self._installed = current.version
            self._moved = {current.version: moved}  # the Update reply reports it
            self._cond.notify_all()  # an Update waiting for this version replies now
            self._counts["pulls"] += 1
            for k, n in pulls.items():  # totals so far: set, not added (Counter.update adds)
                self._counts[k] = n
        self._events.put((event, {}))

    def _on_finished(self, sample: Any) -> None:
        self._events.put(rpc_wire.sample_message(sample))

    # ------------------------------------------------------------ gRPC wiring

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn, raw: bool = False):
            def call(message: bytes, context: grpc.ServicerContext) -> bytes:
                del context
                if raw:
                    return fn(message)
                header, _ = rpc_wire.decode(message)
                return fn(header)

            return grpc.unary_unary_rpc_method_handler(call)

        methods = {
            "Configure": unary(self.configure),
            "Update": unary(self.update),
            "Submit": unary(self.submit, raw=True),
            "Abort": unary(self.abort),
            "Stats": unary(self.stats),
            "Shutdown": unary(self.shutdown),
            "Events": grpc.unary_stream_rpc_method_handler(self.events),
        }
        return grpc.method_handlers_generic_handler(rpc_wire.SERVICE, methods)


_CONFIG_KEYS = (
    "name", "model_config", "engine", "mesh", "partial_rollout", "stop_ids", "transfer", "digests",
)  # fmt: skip
