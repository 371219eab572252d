"""The generation servers the scheduler feeds: health, ranking and guarded calls.

A server that raises from ``check``/``submit``/``abort_prompt``/``update_weights``
(other than a ValueError from ``submit``, which rejects one request) is marked dead
and never called again; one that let a sample miss its deadline is *suspect* until
it delivers again. ``choose`` picks the server for a new sample: healthy before
suspect, up to date before lagging, least loaded, lowest index (ROLL Flash queue
scheduling, arXiv 2510.11345 §5.1). Thread-free: the scheduler serialises access;
the servers themselves may be threads.

The elastic pool (``runtime.control.elastic``) changes the set at a step boundary: ``retire``
takes a server out for good (its devices joined the learner; not a death: it is
never called again and never counted as a failure) and ``add`` appends a new one
(devices the learner gave back). Indices stay stable: a retired index is never
reused, so every table keyed by server index (loads, outstanding rows, the
fleet's weights per server) stays valid.

The fleet builds the servers and the pool and tells the rollout what changed in one
call, ``ServerListener.servers_changed(ServersChanged)``: new weights on every server,
servers retired, servers added. The listener (the rollout scheduler) applies it to
the pool under its lock, so no request meets a server mid-change.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from jaxflash.types import GenerationRequest, PolicyVersion

log = logging.getLogger(__name__)


class GenerationServerProtocol(Protocol):
    """What the rollout scheduler calls on a generation server (``GenerationServer`` fits).

    Attributes:
      partial_rollout: in-flight policy at a weight update ("continue" | "recompute"
        | "restart"); with "restart" a sample still running at an update restarts
        at the new version.
      version: policy version of the weights it generates with now.
    """

    partial_rollout: str

    @property
    def version(self) -> PolicyVersion: ...

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 60.0) -> list[tuple[int, int]]: ...

    def submit(self, request: GenerationRequest) -> None:
        """Queue one sample; ValueError rejects the request, anything else is a dead server."""
        ...

    def abort_prompt(self, prompt_id: int) -> int: ...

    def update_weights(self, params: Any, version: PolicyVersion) -> None: ...

    def check(self) -> None:
        """Raise if the server's loop died.

        A server that can come back (a restarted generation process, which sets the
        class attribute ``recovers = True``) raises at least once after each death
        and passes again once it serves at the published version;
        ``ServerPool.recovered`` then takes it back. A thread server never comes back.
        """
        ...

    def stats(self) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class RetiredServer:
    """What stays of a retired server in the pool: never called (``ServerPool.retire``)."""

    partial_rollout: str
    version: PolicyVersion


class Submitted(enum.Enum):
    """Outcome of a guarded call; DIED is returned once, by the call that found it dead."""

    OK = "ok"
    REJECTED = "rejected"  # submit's ValueError: this request cannot run on the engine
    DIED = "died"  # the server raised anything else: it is now dead


@dataclasses.dataclass(frozen=True)
class SubmitResult:
    status: Submitted
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServersChanged:
    """What the fleet tells the rollout: one change of its servers (applied in this order).

    Attributes:
      retired: servers leaving for good (devices the learner takes); stopped, what they
        finished taken, their requests still out re-queued on the others.
      added: new servers, already holding the published weights; each takes the pool's
        next index (started if the rollout runs).
      version: a newer policy version every live server now installs (None: none).
      weights: with ``version``, what server i installs, by pool index (params on its
        mesh, or a ``WeightOffer``; None for a slot that is gone or holds nothing).
    """

    retired: Sequence[int] = ()
    added: Sequence[GenerationServerProtocol] = ()
    version: int | None = None
    weights: Sequence[Any] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServersApplied:
    """What the rollout did with a ``ServersChanged``.

    Attributes:
      seconds: clock seconds it took (the weights' handover included).
      requeued: requests of the retired servers re-queued on the others.
      added: the pool indices of the added servers, in order.
    """

    seconds: float
    requeued: int = 0
    added: tuple[int, ...] = ()


class ServerListener(Protocol):
    """The one call a fleet makes into the rollout (``RolloutScheduler`` implements it)."""

    def servers_changed(self, change: ServersChanged) -> ServersApplied:
        """Apply ``change`` to the servers the rollout routes to (a step boundary)."""


class ServerPool:
    """Generation servers by index, with their dead and suspect sets.

    Args:
      servers: the servers (at least one), constructed before the scheduler and
        started by ``start``.

    Raises:
      ValueError: no servers.
    """

    def __init__(self, servers: Sequence[GenerationServerProtocol]) -> None:
        if not servers:
            raise ValueError("ServerPool needs at least one generation server")
        self.servers = list(servers)
        self.dead: set[int] = set()
        self.suspect: set[int] = set()
        self.retired: set[int] = set()

    def __len__(self) -> int:
        return len(self.servers)

    @property
    def alive(self) -> list[int]:
        return [i for i in range(len(self.servers)) if i not in self.dead and i not in self.retired]

    def restarts(self, i: int) -> bool:
        """Server i restarts in-flight samples at a weight update."""
        return self.servers[i].partial_rollout == "restart"

    def version(self, i: int) -> PolicyVersion:
        return int(self.servers[i].version)

    def choose(self, load: collections.Counter, version: PolicyVersion, avoid: int = -1) -> int:
        """The server for a new sample, or -1 when every server is dead.

        Args:
          load: server index -> samples outstanding on it.
          version: the learner's published version (servers behind it rank lower).
          avoid: a server to use only if no other is alive (a retry elsewhere).
        """
        alive = self.alive
        if not alive:
            return -1

        def rank(i: int) -> tuple:
            lagging = self.version(i) < version
            return (i == avoid, i in self.suspect, lagging, load[i], i)

        return min(alive, key=rank)

    # -- guarded calls: a raising server is marked dead, never re-raised ------------

    def mark_dead(self, i: int, err: BaseException) -> bool:
        """Mark server i dead; True if it was alive."""
        if i in self.dead:
            return False
        self.dead.add(i)
        self.suspect.discard(i)
        log.warning("generation server %d died: %r", i, err)
        return True

    def submit(self, i: int, request: GenerationRequest) -> SubmitResult:
        try:
            self.servers[i].submit(request)
        except ValueError as err:  # the request cannot run (too long, wrong sampling)
            return SubmitResult(Submitted.REJECTED, err)
        except Exception as err:
            self.mark_dead(i, err)
            return SubmitResult(Submitted.DIED, err)
        return SubmitResult(Submitted.OK)

    def abort(self, i: int, prompt_id: int) -> Submitted:
        """Abort a prompt's samples on server i: OK, or DIED if it died doing it now
        (a server already dead is skipped: OK)."""
        return self._guarded(i, lambda s: s.abort_prompt(prompt_id))

    def update(self, i: int, params: Any, version: PolicyVersion) -> Submitted:
        """Hand new weights to server i: OK, or DIED if it died doing it now."""
        return self._guarded(i, lambda s: s.update_weights(params, version))

    def _guarded(self, i: int, call: Any) -> Submitted:
        if i in self.dead or i in self.retired:
            return Submitted.OK
        try:
            call(self.servers[i])
        except Exception as err:
            self.mark_dead(i, err)
            return Submitted.DIED
        return Submitted.OK

    def check(self) -> list[int]:
        """Servers found dead by this call (their ``check`` raised)."""
        died = []
        for i in self.alive:
            try:
                self.servers[i].check()
            except Exception as err:
                if self.mark_dead(i, err):
                    died.append(i)
        return died

    def recovered(self) -> list[int]:
        """Dead servers whose ``check`` passes again (a restarted process): alive once more.

        Their samples were re-routed when they died; they are not suspect and get
        new samples like any other server.
        """
        back = []
        for i in sorted(self.dead):
            # Only servers that declare they come back (``recovers = True``: a restarted
            # process) are asked: a thread server or a fake whose call raised stays dead
            # even if its ``check`` passes.
            if not getattr(self.servers[i], "recovers", False):
                continue
            try:
                self.servers[i].check()
            except Exception:
                continue
            self.dead.discard(i)
            back.append(i)
            log.warning("generation server %d is back", i)
        return back

    def stats(self) -> list[dict[str, Any]]:
        """Each server's ``stats()`` ({} for a dead or retired one; ``check`` reports deaths)."""
        out = []
        for i, server in enumerate(self.servers):
            try:
                out.append({} if i in self.dead or i in self.retired else dict(server.stats()))
            except Exception:
                out.append({})
        return out

    def take_busy_spans(self) -> list[list[tuple[float, float]]]:
        """Each server's busy (start, end) clock times since the last call; [] for a
        server that does not record them (a generation process, a simulated one),
        a dead or a retired one."""
        out = []
        for i, server in enumerate(self.servers):
            take = getattr(server, "take_busy_spans", None)
            try:
                ok = take is not None and i not in self.dead and i not in self.retired
                out.append(list(take()) if ok else [])
            except Exception:
                out.append([])
        return out

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start every server not retired (a resumed run may retire some before the start)."""
        for i, server in enumerate(self.servers):
            if i not in self.retired:
                server.start()

    def retire(self, i: int) -> GenerationServerProtocol:
        """Take server i out of the pool for good (the elastic pool moved its devices).

        It is chosen, called and checked no more; its index is never reused. The
        caller stops it and re-queues what it held (``RequestRouter.retire``).

        Raises:
          ValueError: i is not a server, or already retired; or it is the last
            server alive (nothing could generate: the elastic plan never does this).
        """
        if not 0 <= i < len(self.servers) or i in self.retired:
            raise ValueError(f"ServerPool.retire: no server {i} to retire (retired {self.retired})")
        if self.alive == [i]:
            raise ValueError(f"ServerPool.retire: server {i} is the last one alive")
        self.retired.add(i)
        self.suspect.discard(i)
        server = self.servers[i]
        # Keep only what the books may still ask (its in-flight policy, its version):
        # the server itself, with its KV cache on devices the learner takes, goes.
        self.servers[i] = RetiredServer(server.partial_rollout, int(server.version))
        return server

    def add(self, server: GenerationServerProtocol) -> int:
        """Append a server (not started here); returns its index."""
        self.servers.append(server)
        return len(self.servers) - 1

    def stop(self) -> None:
        """Stop every server; one stuck in a step is left behind (a daemon thread)."""
        for i, server in enumerate(self.servers):
            if i in self.retired:
                continue  # stopped when it was retired
            try:
                server.stop()
            except Exception as err:
                log.warning("generation server %d did not stop: %r", i, err)
