"""A generation program over several hosts: one SPMD engine, process 0 speaks for it.

A generation slice larger than one host (a v5p engine of tensor = 8 is two hosts)
is one multi-controller JAX program (``jax.distributed``): every process must run
the engine's jitted programs (prefill, decode blocks, weight placement) in the
same order with the same inputs, and each process holds only its own devices'
shards of the weights and of the KV cache. Process 0 runs the gRPC service
(``gen_program.GenerationProgram``: Configure, Update, Submit, Events, health);
the other processes run ``follow`` and replay what process 0 tells them over a
``learner_links`` command channel (JSON + raw arrays over TCP, no pickle):

- ``configure``: build the same engine and ``WeightReceiver`` (``build_program``;
  with ``delta``, a ``sync.transfer_delta.DeltaPuller``: each host pulls the deltas
  of its own blocks in the engine's dtypes, or its blocks whole).
- ``pull``: pull *this process's* shards of a version from the learner
  (``jax.experimental.transfer`` registers process-local buffers only, so every
  host offers or pulls its own blocks); the sender list is rotated so that host
  *i* prefers learner process *i* (``paired``); each host replies with the
  SHA-256 of every block it installed (``shard_digests``) when digests are on.
  Process 0 installs a version only once every host has it; blocks that two
  hosts both hold must have equal digests (a misaligned pull is refused).
- ``start`` / ``step``: build the slot batcher at the first install, then replay
  every wake-up of process 0's server loop (``gen_server.run_commands``: the
  submitted requests, aborts and weight version, then a decode step). The batcher
  is deterministic in these and in the engine's replicated outputs, so every
  process issues the same programs.
- ``exit``: process 0 shuts down.

A dead host is a dead program: process 0 sees a follower's connection close and
reports ``down`` on its event stream, then exits (the controller re-routes its
samples and restarts the whole program, which pulls the current version again);
a follower whose connection to process 0 closes exits at once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxflash.runtime.fleet.learner_links import FollowerLink, LeaderLinks
from jaxflash.runtime.fleet.rpc_wire import WeightOffer
from jaxflash.types import GenerationRequest, SamplingParams

REPLY_TIMEOUT_S = 600.0  # a follower's configure (engine build) or pull, at most


@dataclasses.dataclass
class Built:
    """What ``build_program`` makes of a ``Configure`` on one process."""

    engine: Any
    receiver: Any
    layout_json: dict[str, Any]
    base: Any = None  # LoRA: the frozen base on the engine mesh
    base_digest: str | None = None


def build_program(config: dict[str, Any], host: str) -> Built:
    """The engine and weight receiver a ``Configure`` asks for, on this program's devices.

    With several processes the mesh spans all of them (``jax.devices()``, the
    same order on every process).

    Raises:
      ValueError: the mesh needs more devices than the program has.
    """
    import jax  # noqa: PLC0415  (jax is imported once the program has its devices)

    from jaxflash.generation.engine.state import EngineConfig  # noqa: PLC0415
    from jaxflash.models.adapters import lora as lora_lib  # noqa: PLC0415
    from jaxflash.models.config.model_config import ModelConfig  # noqa: PLC0415
    from jaxflash.models.decoder.transformer import abstract_params  # noqa: PLC0415
    from jaxflash.runtime.model_setup import build_engine, stored_lora_base  # noqa: PLC0415
    from jaxflash.sharding.mesh import make_mesh  # noqa: PLC0415
    from jaxflash.sync.transfer_digest import tree_digest  # noqa: PLC0415
    from jaxflash.sync.transfer_receiver import WeightReceiver  # noqa: PLC0415

    model_config = ModelConfig(**config["model_config"])
    axes = {k: int(v) for k, v in config["mesh"].items()}
    n = int(np.prod(list(axes.values()))) if axes else 1
    if n != jax.device_count() and jax.process_count() > 1:
        raise ValueError(
            f"mesh {axes} needs {n} devices; a generation program over "
            f"{jax.process_count()} hosts uses all of its {jax.device_count()}"
        )
    if n > jax.device_count():
        raise ValueError(f"mesh {axes} needs {n} devices; there are {jax.device_count()}")
    mesh = make_mesh(jax.devices()[:n], axes)
    lora = None if "lora" not in config else lora_lib.LoraConfig(**config["lora"]["config"])
    engine, shardings = build_engine(
        model_config, EngineConfig(**config["engine"]), mesh, lora=lora
    )
    built = Built(engine=engine, receiver=None, layout_json={})
    # Under LoRA the pulled tree is the adapters (what the learner trains); the base
    # is built from its source here, once, and kept across every install.
    shapes = abstract_params(model_config)
    if lora is not None:
        shapes = lora_lib.adapter_layout(model_config, lora)[0]
        base = stored_lora_base(model_config, config["lora"]["source"], lora)
        built.base_digest = tree_digest(base)  # built on this process: addressable
        built.base = engine.place_base(base)
        del base
    template = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings
    )
    built.receiver = WeightReceiver(template, host=host)
    built.layout_json = built.receiver.layout.to_json()
    if config.get("delta") and lora is None:  # deltas of this host's blocks, engine dtypes
        from jaxflash.generation.engine.params import as_engine_dtypes  # noqa: PLC0415
        from jaxflash.sync.transfer_delta import DeltaPuller  # noqa: PLC0415

        view = functools.partial(as_engine_dtypes, model_config=model_config)
        built.receiver = DeltaPuller(built.receiver, view)
    return built


def paired(senders: Sequence[str], process: int) -> list[str]:
    """The learner's sender addresses with learner process ``process % n`` first.

    The receiver takes each block from the first sender that holds it whole, so
    generation host *i* pulls from learner process *i* wherever that one holds
    the block (replicated leaves included), and from another only when it must.
    """
    senders = list(senders)
    k = process % len(senders) if senders else 0
    return senders[k:] + senders[:k]


def shard_digests(tree: Any) -> dict[str, str]:
    """SHA-256 (hex) of every block this process holds, keyed ``"<path>@<index>"``.

    ``<path>`` is ``jax.tree_util.keystr`` of the leaf, ``<index>`` the block's
    ``[[start, stop], ...]`` per dimension; a block on several local devices is
    hashed once. The learner logs the same for the blocks it staged, so a test can
    compare every installed block with its source bit for bit.
    """
    import jax  # noqa: PLC0415

    out: dict[str, str] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        for shard in leaf.addressable_shards:
            index = [list(s.indices(d)[:2]) for s, d in zip(shard.index, leaf.shape, strict=True)]
            key = f"{name}@{index}"
            if key not in out:
                out[key] = hashlib.sha256(np.asarray(shard.data).tobytes()).hexdigest()
    return out


def check_host_shards(
    params: Any, replies: dict[int, dict[str, Any]], digests: bool
) -> list[dict[str, str]] | None:
    """Process 0's check of one version's pulls on every host.

    Args:
      params: what process 0 pulled (its own shards).
      replies: each other host's ``pulled`` reply, by process index.
      digests: compare block digests (``shard_digests``); else only success.

    Returns:
      Per host (process index order) its block digests, or None without digests.

    Raises:
      TransferError: a host's pull failed (its kind), or two hosts hold the same
        block with different bytes (PROTOCOL: a misaligned pull; never installed).
    """
    from jaxflash.sync.transfer_wire import TransferError, TransferErrorKind  # noqa: PLC0415

    for i, r in sorted(replies.items()):
        if not r["ok"]:
            kind = next((k for k in TransferErrorKind if k.value == r.get("kind")),
                        TransferErrorKind.PROTOCOL)  # fmt: skip
            raise TransferError(kind, f"generation host {i}: {r.get('error')}")
    if not digests:
        return None
    per_host = [shard_digests(params)] + [dict(r["digests"]) for _, r in sorted(replies.items())]
    seen: dict[str, tuple[int, str]] = {}
    for i, blocks in enumerate(per_host):
        for key, digest in blocks.items():
            first = seen.setdefault(key, (i, digest))
            if first[1] != digest:
                raise TransferError(
                    TransferErrorKind.PROTOCOL,
                    f"block {key}: host {first[0]} and host {i} installed different bytes",
                )
    return per_host


def encode_commands(
    commands: list[tuple[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """A server wake-up's inbox as JSON items + prompt arrays (``decode_commands``)."""
    items: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    for kind, payload in commands:
        if kind == "submit":
            r = payload
            arrays[f"p{len(items)}"] = np.asarray(r.prompt_tokens, np.int32)
            items.append({"kind": "submit", "prompt_id": int(r.prompt_id),
                          "sample_index": int(r.sample_index), "seed": int(r.seed),
                          "sampling": dataclasses.asdict(r.sampling)})  # fmt: skip
        else:
            items.append({"kind": "abort", "keys": [[int(a), int(b)] for a, b in payload]})
    return items, arrays


def decode_commands(
    items: list[dict[str, Any]], arrays: dict[str, np.ndarray]
) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for i, it in enumerate(items):
        if it["kind"] == "submit":
            request = GenerationRequest(
                prompt_id=int(it["prompt_id"]), sample_index=int(it["sample_index"]),
                prompt_tokens=arrays[f"p{i}"], sampling=SamplingParams(**it["sampling"]),
                seed=int(it["seed"]),
            )  # fmt: skip
            out.append(("submit", request))
        else:
            out.append(("abort", [(int(a), int(b)) for a, b in it["keys"]]))
    return out


class ProgramHosts:
    """Process 0's end: tells the other hosts what to run and collects their replies.

    Args:
      host: interface of the command channel (reachable from the other hosts).
      on_lost: called once (from a reader thread) with a message when another
        host's connection closes while the program runs.

    Raises:
      ConnectionError: not every host connected (``LeaderLinks``).
    """

    def __init__(self, *, host: str, on_lost: Callable[[str], None]):
        self._links = LeaderLinks(host=host)
        self._on_lost = on_lost
        self._closing = False
        self._replies: dict[int, queue.Queue] = {i: queue.Queue() for i in self._links.followers}
        for i in self._links.followers:
            name = f"gen-host-{i}"
            threading.Thread(target=self._read, args=(i,), name=name, daemon=True).start()

    @property
    def pids(self) -> dict[int, int]:
        """The other hosts' process ids, by process index."""
        return dict(self._links.follower_pids)

    def _read(self, process: int) -> None:
        while True:
            try:
                self._replies[process].put(self._links.read(process))
            except ConnectionError as err:
                self._replies[process].put(({"op": "lost", "error": str(err)}, {}))
                if not self._closing:
                    self._on_lost(f"generation host {process} is gone: {err}")
                return

    def gather(self, op: str) -> dict[int, dict[str, Any]]:
        """One ``op`` reply from every other host, by process index.

        Raises:
          ConnectionError: a host is gone or did not answer in ``REPLY_TIMEOUT_S``.
        """
        out = {}
        for i, replies in sorted(self._replies.items()):
            try:
                header, _ = replies.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty as err:
                raise ConnectionError(f"generation host {i} did not answer {op}") from err
            if header.get("op") != op:
                raise ConnectionError(f"generation host {i}: {header.get('error', header)}")
            out[i] = header
        return out

    def check_configured(self) -> None:
        """Every other host built the configuration process 0 posted.

        Raises:
          ValueError: a host refused it (its reason, by process index).
        """
        failed = {i: r["error"] for i, r in self.gather("configured").items() if not r["ok"]}
        if failed:
            raise ValueError(f"generation hosts refused the configuration: {failed}")

    def post(self, op: str, arrays: dict[str, np.ndarray] | None = None, **fields: Any) -> None:
        self._links.post(op, arrays, **fields)

    def mirror(self, commands: list[tuple[str, Any]], version: int | None) -> None:
        """``GenerationServer``'s mirror: every wake-up, before process 0 runs it."""
        items, arrays = encode_commands(commands)
        self._links.post("step", arrays, commands=items, version=version)

    def close(self) -> None:
        """Tell the other hosts to exit."""
        self._closing = True
        self._links.close()


class _Follower:
    """A generation host other than 0: the engine, receiver and batcher it replays on."""

    def __init__(self, link: FollowerLink, host: str):
        self.link, self.host = link, host
        self.built: Built | None = None
        self.config: dict[str, Any] = {}
        self.params: dict[int, Any] = {}  # pulled versions (engine-ready), newest kept
        self.batcher: Any = None
        self._lock = threading.Lock()

    def configure(self, header: dict[str, Any]) -> None:
        try:
            self.built = build_program(header["config"], self.host)
            self.config = header["config"]
            self.link.send("configured", ok=True)
        except Exception as err:  # said to process 0, which refuses the Configure
            self.link.send("configured", ok=False, error=f"{type(err).__name__}: {err}")

    def pull(self, header: dict[str, Any]) -> None:
        """Pull this host's shards of the offer (a thread: replays go on meanwhile)."""
        import jax  # noqa: PLC0415

        from jaxflash.sync.transfer_wire import TransferError  # noqa: PLC0415

        offer = WeightOffer.from_json(header["offer"])
        built, transfer = self.built, self.config["transfer"]
        current, before = built.receiver.current, built.receiver.stats.bytes
        if current is None or current.version != offer.version:
            try:
                current = built.receiver.pull(
                    paired(offer.senders, jax.process_index()), method=transfer["method"],
                    chunk_bytes=int(transfer["chunk_bytes"]),
                    timeout_s=float(transfer["timeout_s"]), version=offer.version,
                )  # fmt: skip
            except Exception as err:  # said to process 0, which retries the version
                kind = err.kind.value if isinstance(err, TransferError) else "error"
                self.link.send("pulled", ok=False, version=offer.version, kind=kind,
                               error=f"{type(err).__name__}: {err}")  # fmt: skip
                return
        params = current.params
        if built.base is not None:
            params = built.engine.with_adapters(built.base, params)
        with self._lock:
            self.params = {offer.version: params}
        digests = shard_digests(current.params) if self.config.get("digests") else None
        moved = built.receiver.stats.bytes - before  # deltas' or the full tree's payload
        self.link.send("pulled", ok=True, version=offer.version, digests=digests, bytes=moved)

    def start(self, header: dict[str, Any]) -> None:
        from jaxflash.generation.slot_loop import SlotBatcher  # noqa: PLC0415

        version = int(header["version"])
        with self._lock:
            params = self.params[version]
        stop_ids = [int(i) for i in self.config["stop_ids"]]
        self.batcher = SlotBatcher(
            self.built.engine, params, policy_version=version, stop_ids=stop_ids
        )

    def step(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        from jaxflash.runtime.fleet.gen_server import run_commands  # noqa: PLC0415

        commands = decode_commands(header["commands"], arrays)
        weights = None
        if header.get("version") is not None:
            version = int(header["version"])
            with self._lock:
                weights = (self.params[version], version)
        run_commands(self.batcher, commands, weights, str(self.config["partial_rollout"]))


def follow(*, host: str = "127.0.0.1") -> int:
    """A generation host other than process 0: replay process 0's commands until it says
    exit (returns 0) or goes away (returns 1)."""
    link = FollowerLink(sender_address="")
    me = _Follower(link, host)
    try:
        while True:
            header, arrays = link.next()
            op = header.pop("op")
            if op == "exit":
                return 0
            if op == "configure":
                me.configure(header)
            elif op == "pull":
                threading.Thread(target=me.pull, args=(header,), daemon=True).start()
            elif op == "start":
                me.start(header)
            elif op == "step":
                me.step(header, arrays)
            else:
                raise ValueError(f"generation host: unknown command {op!r}")
    except ConnectionError:
        return 1
    finally:
        link.close()
