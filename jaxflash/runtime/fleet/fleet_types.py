"""What both fleets share: the settings every server is built with, and what a
publish and an elastic move report (``fleets``: ``ThreadFleet``, ``ProcessFleet``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxflash.runtime.fleet.gen_server import GenerationServer


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What every server of a fleet is built with, given once (``make_fleet``).

    Attributes:
      on_finished: where finished samples go (the rollout's ``Inbox.generated``).
      clock: the run's time source (timings; thread servers' too).
      server_factory: builds each thread server like ``GenerationServer`` (tests
        wrap it to inject faults; generation programs take only the default).
    """

    on_finished: Callable[[Any], None]
    clock: Any
    server_factory: Callable[..., Any] = GenerationServer


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightSync:
    """One publish: the copy (or offer + pull) and the handover to the servers.

    Attributes:
      copy_s: seconds until every server held the weights (D2D copies, or pulls).
      handover_s: seconds the rollout took to hand them over and release capacity
        (``ServersApplied.seconds``).
      bytes: bytes moved, all servers together (the adapters only under LoRA; under
        delta publish the deltas, or the full engine-side tree of a slot that fell back).
      changed_frac, full_fallbacks: thread delta publish (``DeltaStats.sync_fields``).
    """

    copy_s: float
    handover_s: float
    bytes: int
    changed_frac: float | None = None
    full_fallbacks: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resized:
    """One ``ThreadFleet.resize``: requests re-queued, the learner's reshard, new slots."""

    requeued: int
    reshard_bytes: int
    added: tuple[int, ...]
