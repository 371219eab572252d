"""Fault handling of the rollout scheduler: sample deadlines, retries and dead servers.

No silent hang (../shared/cases/rl_pitfalls.md): a sample not back within its
deadline is aborted and retried elsewhere, then its prompt fails; a server whose
thread died is marked dead and its samples are rerouted."""

from __future__ import annotations

import time


class FaultHandling:
    """Mixed into ``RolloutScheduler`` (scheduler.py); uses its state."""

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        late = [k for k, r in self._out.items() if now - r.dispatched_at > self.deadline_s]
        for key in late:
            req = self._out.get(key)
            if req is None:
                continue  # resubmitted as a sibling of an earlier late one
            self.counters["samples_timed_out"] += 1
            self._suspect.add(req.server)
            on_server = [
                (k, r) for k, r in self._out.items() if k[0] == key[0] and r.server == req.server
            ]
            self._server_abort(req.server, key[0])
            on_server = [(k, r) for k, r in on_server if self._out.get(k) is r]  # not rerouted
            for k, _ in on_server:
                del self._out[k]
            if req.attempts >= self.max_retries:
                self.counters["samples_failed"] += 1
                self.buffer.fail(
                    key[0],
                    f"sample {key[1]} not back within {self.deadline_s}s after "
                    f"{req.attempts + 1} tries",
                )
                self._abort_prompt(key[0])
                continue
            self.counters["samples_retried"] += 1
            for k, r in on_server:  # the server dropped all of them: send them elsewhere
                tries = r.attempts + 1 if k == key else r.attempts
                self._dispatch(r.request, attempts=tries, avoid=req.server)

    def _check_servers(self) -> None:
        for i, server in enumerate(self.servers):
            if i not in self._dead and hasattr(server, "check"):
                try:
                    server.check()
                except Exception as err:
                    self._mark_dead(i, err)

    def _mark_dead(self, i: int, err: BaseException) -> None:
        """A server raised: stop using it and send its outstanding samples elsewhere."""
        if i in self._dead:
            return
        self._dead.add(i)
        self.counters["server_failures"] += 1
        print(f"generation server {i} died: {err!r}", flush=True)
        lost = [(k, r) for k, r in self._out.items() if r.server == i]
        for k, r in lost:
            del self._out[k]
            self.counters["samples_rerouted"] += 1
            self._dispatch(r.request, r.attempts, avoid=i)

    def _abort_prompt(self, pid: int) -> None:
        """Abort a prompt's outstanding requests on every server holding one."""
        holders = {r.server for k, r in self._out.items() if k[0] == pid}
        for k in [k for k in self._out if k[0] == pid]:
            del self._out[k]
            self.counters["samples_aborted"] += 1
        for i in sorted(holders - self._dead):
            self._server_abort(i, pid)

    def _server_abort(self, i: int, pid: int) -> None:
        try:
            self.servers[i].abort_prompt(pid)
        except Exception as err:  # dead: its other work is rerouted
            self._mark_dead(i, err)
