"""A generation program in another process, behind the scheduler's ``GenerationServerProtocol``.

``RemoteGenerationServer`` is to a generation program (``runtime.fleet.gen_program``)
what ``GenerationServer`` is to a thread: the scheduler calls ``submit``,
``abort_prompt``, ``update_weights``, ``check``, ``stats`` the same way, and
finished samples reach ``on_finished`` (the controller's ``Inbox``) from a
reader thread of the program's event stream. ``update_weights`` takes a
``WeightOffer`` (where to pull which version) instead of arrays: the program
pulls the weights itself from the learner's ``WeightSender``s.

Supervision (a thread per server):

- Death is detected when the event stream breaks (the process died: at once) or
  carries no heartbeat for ``heartbeat_timeout_s`` (a hung process: it is killed).
  From then on ``check()`` raises, so the scheduler marks the server dead and
  re-routes its outstanding samples to the others; this object forgets them (a
  late sample of the dead incarnation is never delivered).
- A ``LocalProgram`` is then restarted (up to ``max_restarts`` times), configured
  again and told to pull the *current* offer (``OfferBoard``: the latest version
  the learner published, so a restart during a publish gets the newest). Once it
  applied that version, ``check()`` passes again, after it has raised at least
  once: the scheduler's ``ServerPool.recovered`` takes it back.

Every state change is appended to ``log_path`` (JSON lines: up, pulling,
installed with its digest, pull_failed, died with the detection time, restarting).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxflash.runtime.fleet import rpc_wire
from jaxflash.runtime.fleet.gen_endpoint import ProgramClient
from jaxflash.runtime.fleet.rpc_wire import Status, WeightOffer
from jaxflash.runtime.rollout.server_metrics import CUMULATIVE_STATS
from jaxflash.types import GenerationRequest, PolicyVersion, RequestKey, Sample

log = logging.getLogger(__name__)

# ``CUMULATIVE_STATS``: counters ``GenerationServer.stats`` accumulates over its life
# (``rollout.server_metrics`` differences them per step). A restarted program counts from
# 0 again, so the totals of earlier incarnations are carried over: the per-step
# differences never go negative.


class RemoteServerDownError(RuntimeError):
    """The generation program is down (died, hung, failed, or restarting)."""


class OfferBoard:
    """The latest ``WeightOffer`` the learner published (thread-safe); restarts read it."""

    def __init__(self, offer: WeightOffer):
        self._lock = threading.Lock()
        self._offer = offer

    def post(self, offer: WeightOffer) -> None:
        with self._lock:
            if offer.version > self._offer.version:
                self._offer = offer

    @property
    def latest(self) -> WeightOffer:
        with self._lock:
            return self._offer


class RemoteGenerationServer:
    """``GenerationServerProtocol`` over gRPC to a generation program.

    Args:
      client: a connected, configured ``ProgramClient``.
      board: the learner's latest offer; the program starts at (and every restart
        resyncs to) ``board.latest``.
      partial_rollout: the program's in-flight policy at an update (as configured).
      on_finished: called with each finished Sample from the reader thread.
      heartbeat_timeout_s: silence on the event stream after which the program is
        declared hung (and killed, if local).
      max_restarts: restarts of a ``LocalProgram`` before it stays dead.
      start_timeout_s: how long ``start`` waits for the first weights.
      log_path: JSON-lines event log ("" = none).
    """

    recovers = True  # ServerPool.recovered takes it back after a restart

    def __init__(
        self,
        client: ProgramClient,
        board: OfferBoard,
        *,
        partial_rollout: str,
        on_finished: Callable[[Sample], None],
        heartbeat_timeout_s: float = 10.0,
        max_restarts: int = 5,
        start_timeout_s: float = 300.0,
        log_path: str = "",
    ):
        self.name = client.name
        self.partial_rollout = partial_rollout
        self._client, self._board = client, board
        self._on_finished = on_finished
        self._heartbeat_timeout_s = float(heartbeat_timeout_s)
        self._max_restarts, self._start_timeout_s = int(max_restarts), float(start_timeout_s)
        self._log_path = log_path
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._up = False
        self._error: BaseException | None = RemoteServerDownError(f"{self.name}: not started")
        self._acknowledged = True  # the initial "not started" needs no acknowledgement
        self._incarnation = 0
        self._version = int(board.latest.version)
        self._requested = int(board.latest.version)
        self._pulled = -1  # the last version ``pull`` saw installed
        self._outstanding: set[RequestKey] = set()
        self._routes: dict[RequestKey, Callable[[Sample], None]] = {}  # not to on_finished
        self._counts: collections.Counter = collections.Counter()
        self._last_event = time.monotonic()
        self._stream: Any = None
        self._stopping = False
        self._carried = dict.fromkeys(CUMULATIVE_STATS, 0.0)  # totals of earlier incarnations
        self._last_stats: dict[str, float] = {}  # this incarnation's latest totals
        self._thread = threading.Thread(
            target=self._supervise, name=f"remote-{self.name}", daemon=True
        )

    # ------------------------------------------------------------ the protocol

    @property
    def version(self) -> PolicyVersion:
        """The version the program generates with now (as last reported)."""
        with self._cond:
            return self._version

    @property
    def started(self) -> bool:
        """``start`` was called (the supervisor runs, or ran)."""
        return self._thread.ident is not None

    def start(self) -> None:
        """Start supervising; returns once the program runs the board's version. Again
        (the scheduler's start after an evaluation started it): only waits for that.

        Raises:
          RemoteServerDownError: not up within ``start_timeout_s``.
        """
        if not self.started:
            self._thread.start()
        end = time.monotonic() + self._start_timeout_s
        with self._cond:
            while not self._up and time.monotonic() < end and self._thread.is_alive():
                self._cond.wait(0.1)
            if not self._up:
                raise RemoteServerDownError(f"{self.name}: not up after {self._start_timeout_s:g}s")

    def stop(self, timeout_s: float = 60.0) -> list[RequestKey]:
        """Shut the program down; returns the keys neither delivered nor aborted."""
        with self._cond:
            self._stopping = True
            stream = self._stream
            self._cond.notify_all()
        self._client.shutdown(timeout_s=min(timeout_s, 10.0))
        if stream is not None:
            stream.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._cond:
            delivered = self._counts["delivered"]
        self._write_log("stopped", delivered=delivered)
        with self._cond:
            return sorted(self._outstanding)

    @property
    def incarnation(self) -> int | None:
        """Which life of the program is up (each death starts a new one); None while it
        is down. Requests submitted to a life that ended are lost (never delivered)."""
        with self._cond:
            return self._incarnation if self._up and not self._stopping else None

    def submit(
        self, request: GenerationRequest, on_finished: Callable[[Sample], None] | None = None
    ) -> None:
        """Queue one sample; ``on_finished``: where its Sample goes instead of the
        scheduler's callback (held-out evaluation, ``fleet.eval_generation``).

        Raises:
          ValueError: the program rejects the request, or its key is outstanding here.
          RemoteServerDownError: the program is down.
        """
        key = (int(request.prompt_id), int(request.sample_index))
        with self._cond:
            incarnation = self._raise_if_down()
            if key in self._outstanding:
                raise ValueError(f"{self.name}: request {key} already submitted")
            self._outstanding.add(key)
            if on_finished is not None:
                self._routes[key] = on_finished
        status, fields = self._call("Submit", rpc_wire.encode_request(request), incarnation)
        if status is Status.REJECTED:
            with self._cond:
                self._outstanding.discard(key)
                self._routes.pop(key, None)
            raise ValueError(f"{self.name}: {fields.get('error')}")
        with self._cond:
            self._counts["submitted"] += 1

    def abort_prompt(self, prompt_id: int) -> int:
        with self._cond:
            incarnation = self._raise_if_down()
            keys = [k for k in self._outstanding if k[0] == int(prompt_id)]
            self._outstanding.difference_update(keys)  # never delivered from now on
            for k in keys:
                self._routes.pop(k, None)
            self._counts["aborted"] += len(keys)
        if keys:
            self._call("Abort", rpc_wire.encode({"prompt_id": int(prompt_id)}), incarnation)
        return len(keys)

    def update_weights(self, params: Any, version: PolicyVersion) -> None:
        """Tell the program to pull ``params`` (a ``WeightOffer`` of ``version``).

        Raises:
          ValueError: not a WeightOffer of ``version``, or a version not above the
            last one given.
        """
        if not isinstance(params, WeightOffer) or params.version != int(version):
            raise ValueError(f"{self.name}: update_weights needs a WeightOffer of v{version}")
        self._board.post(params)
        with self._cond:
            if version == self._requested and self._pulled == version:
                return  # ``pull`` installed it already (ProcessFleet.publish)
            if version <= self._requested:
                raise ValueError(
                    f"{self.name}: version {version} after version {self._requested} "
                    "(versions only go up)"
                )
            self._requested = int(version)
            incarnation = self._raise_if_down()
        self._call("Update", rpc_wire.encode({"offer": params.to_json()}), incarnation)

    def pull(self, offer: WeightOffer, timeout_s: float) -> int | None:
        """Have the program install ``offer`` now; returns once it is installed, with
        the payload bytes its pull moved (None: not known, e.g. installed before).

        After this, requests submitted here start at ``offer.version`` (what
        ``update_weights`` promises a thread server's callers); ``update_weights``
        of the same version is then a no-op. ``ProcessFleet.publish`` calls it on
        every server at once, so programs pull in parallel.

        Raises:
          RemoteServerDownError: the program is down, or did not install it in
            ``timeout_s`` (it is then taken down and restarted).
        """
        self._board.post(offer)
        with self._cond:
            incarnation = self._raise_if_down()
        message = rpc_wire.encode({"offer": offer.to_json(), "wait": True, "timeout_s": timeout_s})
        _, fields = self._call("Update", message, incarnation, timeout_s=timeout_s + 10.0)
        with self._cond:
            if incarnation == self._incarnation:
                self._requested = max(self._requested, int(offer.version))
                self._pulled = int(offer.version)
        moved = fields.get("moved")
        return None if moved is None else int(moved)

    def check(self) -> None:
        """Raise while the program is down; a restarted program passes again once this
        has raised at least once since it died (so every death is seen).

        Raises:
          RemoteServerDownError: from the error that took it down.
        """
        with self._cond:
            if (
                self._up
                and self._stream is not None
                and time.monotonic() - self._last_event > self._heartbeat_timeout_s
            ):
                silent = time.monotonic() - self._last_event
                self._down(RemoteServerDownError(f"{self.name}: no heartbeat for {silent:.1f}s"))
            if self._error is None:
                return
            if self._up and self._acknowledged:
                self._error = None
                return
            self._acknowledged = True
            raise RemoteServerDownError(f"{self.name} is down: {self._error}") from self._error

    def stats(self) -> dict[str, Any]:
        with self._cond:
            incarnation = self._raise_if_down()
        _, fields = self._call("Stats", rpc_wire.encode({}), incarnation)
        with self._cond:
            out = dict(fields["stats"])
            if incarnation == self._incarnation:
                self._last_stats = {k: float(out.get(k, 0)) for k in CUMULATIVE_STATS}
            for k in CUMULATIVE_STATS:
                out[k] = float(out.get(k, 0)) + self._carried[k]
            out.update(
                queued_or_running=len(self._outstanding),
                version=self._version,
                requested_version=self._requested,
                restarts=self._counts["restarts"],
                deaths=self._counts["deaths"],
                pid=fields["program"].get("pid"),
            )
            return out

    def __enter__(self) -> RemoteGenerationServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ calls and deaths

    def _raise_if_down(self) -> int:
        """Under the lock: the current incarnation, or raise if down/stopped."""
        if self._stopping:
            raise RemoteServerDownError(f"{self.name} is stopped")
        if self._error is not None and not self._up:
            raise RemoteServerDownError(f"{self.name} is down: {self._error}") from self._error
        return self._incarnation

    def _call(
        self, method: str, message: bytes, incarnation: int, timeout_s: float | None = None
    ) -> tuple[Status, dict]:
        """A unary call; a transport fault or DOWN takes this incarnation down and raises."""
        try:
            status, fields = self._client.call(method, message, timeout_s=timeout_s)
        except Exception as err:  # grpc.RpcError, ProgramUnavailableError: the program is gone
            with self._cond:
                if incarnation == self._incarnation:
                    self._down(err)
            raise RemoteServerDownError(f"{self.name}: {method} failed: {err!r}") from err
        if status is Status.DOWN:
            err = RemoteServerDownError(f"{self.name}: {fields.get('error')}")
            with self._cond:
                if incarnation == self._incarnation:
                    self._down(err)
            raise err
        return status, fields

    def _down(self, err: BaseException) -> None:
        """Under the lock: this incarnation is dead; forget its samples (re-routed by
        the scheduler once ``check`` raises) and wake the supervisor."""
        if not self._up and self._error is not None:
            return
        lost = len(self._outstanding)
        self._up, self._error, self._acknowledged = False, err, False
        self._incarnation += 1
        self._outstanding.clear()
        self._routes.clear()
        for k, v in self._last_stats.items():
            self._carried[k] += v
        self._last_stats = {}
        self._counts["deaths"] += 1
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
        self._cond.notify_all()
        log.warning("generation program %s is down (%d samples lost): %r", self.name, lost, err)
        self._write_log("died", error=repr(err), lost=lost, delivered=self._counts["delivered"])

    def _supervise(self) -> None:
        restarting = False
        while True:
            with self._cond:
                if self._stopping:
                    return
                incarnation = self._incarnation
            try:
                if restarting:
                    self._write_log("restarting")
                    self._client.endpoint.kill()
                    if self._client.endpoint.restartable:
                        self._client.endpoint.launch()
                    self._client.connect()
                self._serve(incarnation)  # returns only once declared down elsewhere
            except Exception as err:
                with self._cond:
                    if not self._stopping and incarnation == self._incarnation:
                        self._down(err)
            with self._cond:
                if self._stopping:
                    return
                if self._counts["restarts"] >= self._max_restarts:
                    self._write_log("gave_up", restarts=self._counts["restarts"])
                    return
                self._counts["restarts"] += 1
            restarting = True
            time.sleep(0.2)

    def _serve(self, incarnation: int) -> None:
        """Subscribe, resync to the board's offer, then read events until the stream ends."""
        stream = self._client.events()
        with self._cond:
            self._stream, self._last_event = stream, time.monotonic()
        offer = self._board.latest
        self._call("Update", rpc_wire.encode({"offer": offer.to_json()}), incarnation)
        sent = offer.version
        for header, arrays in self._client.decode_events(stream):
            kind = header.get("type")
            deliver, to = None, self._on_finished
            with self._cond:
                if incarnation != self._incarnation:
                    return  # declared down meanwhile (no heartbeat); the supervisor restarts it
                self._last_event = time.monotonic()
                if kind == "sample":
                    key = (int(header["prompt_id"]), int(header["sample_index"]))
                    if key in self._outstanding:
                        self._outstanding.discard(key)
                        self._counts["delivered"] += 1
                        deliver = rpc_wire.sample_from_message(header, arrays)
                        to = self._routes.pop(key, self._on_finished)
                elif kind == "version":
                    self._version = int(header["version"])
                    self._write_log("version", version=self._version)
                    if not self._up and self._version >= offer.version:
                        self._up = True
                        self._requested = max(self._requested, self._version)
                        self._cond.notify_all()
                        self._write_log("up", version=self._version, pid=self._client.endpoint.pid)
                elif kind == "down":
                    raise RemoteServerDownError(f"{self.name}: {header.get('error')}")
                elif kind in ("pulling", "installed", "pull_failed"):
                    self._write_log(kind, **{k: v for k, v in header.items() if k != "type"})
                latest = self._board.latest
            if deliver is not None:
                to(deliver)
            if latest.version > sent:  # published while this program was restarting
                self._call("Update", rpc_wire.encode({"offer": latest.to_json()}), incarnation)
                sent = latest.version
        raise RemoteServerDownError(f"{self.name}: event stream ended")

    def _write_log(self, event: str, **fields: Any) -> None:
        if not self._log_path:
            return
        line = {"t": time.time(), "event": event, "server": self.name, **fields}
        with open(self._log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
