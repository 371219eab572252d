"""Generation stalls: how long admission was held, and how many slots sat idle meanwhile.

The staleness bound costs generation time when admission is refused while a
server could run more: with every policy the ``(α+1)·B`` capacity of ``Admission``
holds it until the next publish releases trained prompts; with
``stale_policy="pace"`` the ``Pacer`` also refuses a prompt that would push an open
one past its deadline, and the learner *waits* for a due straggler (capacity
comes back later). ``Admission.held_by`` says which holds it; ``AdmissionStalls``
measures both in the real runtime, as the simulator's ``SimResult.admission_idle``
does under a virtual clock:

* ``admission_holds_<reason>``: times admission went from open to held for that
  reason (``capacity`` or ``pacer``; nothing held while the source is exhausted or
  every server is down, those are not the bound's doing);
* ``admission_held_<reason>_s``: seconds held;
* ``slots_idle_held_<reason>_s``: slot-seconds a decode slot had nothing to run or
  queue meanwhile (``rollout.num_slots`` per live server minus samples out on the
  servers); ``slots_idle_held_frac``: both over every slot-second observed -- the
  runtime's ``admission_idle``.

The state is sampled where it changes (each ``observe``: after a pump step, a batch
taken, a publish) and held constant until the next one, so the figures are exact
up to the pump period (20 ms). Since this process started: not kept across a
resume.

Thread-free: the scheduler serialises access.
"""

from __future__ import annotations

REASONS = ("capacity", "pacer")


class AdmissionStalls:
    """Time and idle slot-seconds with admission held, per reason (see the module).

    Args:
      slots_per_server: decode slots per generation server (``rollout.num_slots``);
        0 = unknown: only the counts and seconds are measured.
    """

    def __init__(self, slots_per_server: int = 0) -> None:
        if slots_per_server < 0:
            raise ValueError(f"slots_per_server must be >= 0, got {slots_per_server}")
        self.K = int(slots_per_server)
        self.holds = dict.fromkeys(REASONS, 0)
        self.held_s = dict.fromkeys(REASONS, 0.0)
        self.idle_slot_s = dict.fromkeys(REASONS, 0.0)
        self.slot_s = 0.0  # every slot-second observed
        self._last: tuple[float, str | None, int, int] | None = None  # t, reason, slots, idle

    def observe(self, now: float, reason: str | None, servers: int, outstanding: int) -> None:
        """The state from ``now`` on: admission held for ``reason`` (None: not held), with
        ``servers`` live servers and ``outstanding`` samples on them. What held since the
        last call is accounted first.

        Raises:
          ValueError: an unknown reason.
        """
        if reason is not None and reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS} or None, got {reason!r}")
        if self._last is not None:
            t, was, slots, idle = self._last
            dt = max(0.0, now - t)
            self.slot_s += dt * slots
            if was is not None:
                self.held_s[was] += dt
                self.idle_slot_s[was] += dt * idle
        if reason is not None and (self._last is None or self._last[1] != reason):
            self.holds[reason] += 1
        slots = self.K * max(0, servers)
        self._last = (now, reason, slots, max(0, slots - outstanding))

    def stats(self) -> dict[str, float]:
        """The figures so far (metrics.jsonl's ``rollout`` section)."""
        out: dict[str, float] = {}
        for r in REASONS:
            out[f"admission_holds_{r}"] = self.holds[r]
            out[f"admission_held_{r}_s"] = self.held_s[r]
            if self.K:
                out[f"slots_idle_held_{r}_s"] = self.idle_slot_s[r]
        if self.K:
            idle = sum(self.idle_slot_s.values())
            out["slots_idle_held_frac"] = idle / self.slot_s if self.slot_s else 0.0
        return out
