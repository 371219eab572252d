"""The controller of a run with a replay cycle: adaptive, a fixed schedule, or none.

``controller.kind="adaptive"`` builds ``replay.controller.AdaptiveController`` (its
rules are documented there); ``"fixed"`` a ``FixedSchedule`` (for ablations) from
``controller.replay_schedule`` (rho by step) and, with the elastic pool,
``controller.device_schedule`` (learner devices by step); ``"none"``: no controller
(rho = replay.ratio every step). ``runtime.control.replay_cycle`` feeds it each step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxflash.replay.controller import AdaptiveController, Decision, FixedSchedule, in_flight_for
from jaxflash.runtime.config.replay_spec import ControllerSpec, ReplaySpec


def make_controller(
    controller: ControllerSpec,
    replay: ReplaySpec,
    initial: Decision,
    *,
    batch_samples: int,
    group_size: int,
    device_floors: dict[str, int] | None = None,
    state: dict[str, Any] | None = None,
) -> AdaptiveController | FixedSchedule | None:
    """The run's controller, starting from ``initial`` (alpha: the user's maximum).

    Args:
      controller, replay: the config sections.
      initial: the starting decision (replay.ratio, rollout.async_ratio, the split).
      batch_samples, group_size: B * G and G.
      device_floors: an elastic run's device_quantum / min_learner_devices /
        min_generation_devices for the adaptive controller (None: its defaults).
      state: the adaptive controller's ``state_dict`` from a checkpoint.
    """
    if controller.kind == "adaptive":
        config = controller.controller_config(
            batch_samples=batch_samples,
            max_async_ratio=initial.async_ratio,
            group_size=group_size,
            **dict(device_floors or {}),
        )
        adaptive = AdaptiveController(config, initial)
        if state:
            adaptive.load_state_dict(state)
        return adaptive
    if controller.kind == "fixed":
        return FixedSchedule(
            fixed_decisions(
                controller.schedule() or [(0, replay.ratio)],
                controller.device_steps(),
                initial,
                batch_samples=batch_samples,
                group_size=group_size,
            )
        )
    return None


def fixed_decisions(
    rhos: Sequence[tuple[int, float]],
    learner_sizes: Sequence[tuple[int, int]],
    initial: Decision,
    *,
    batch_samples: int,
    group_size: int,
) -> list[tuple[int, Decision]]:
    """A ``FixedSchedule``'s (from_step, Decision) list from its two schedules.

    Args:
      rhos: [(from_step, rho)], the first from_step 0 (``replay_schedule``).
      learner_sizes: [(from_step, learner devices)] (``device_schedule``; [] keeps
        ``initial``'s split).
      initial: the run's starting decision (alpha, split; the total device count).
      batch_samples, group_size: B * G and G (requests in flight per rho).

    Returns:
      One entry per from_step of either schedule, each with the last rho and the last
      learner size in force there.
    """
    total = initial.learner_devices + initial.generation_devices
    steps = sorted({s for s, _ in rhos} | {s for s, _ in learner_sizes})
    out = []
    for step in steps:
        rho = [r for s, r in rhos if s <= step][-1]
        sizes = [n for s, n in learner_sizes if s <= step]
        learner = sizes[-1] if sizes else initial.learner_devices
        in_flight = in_flight_for(initial.async_ratio, rho, batch_samples, group_size)
        out.append(
            (
                step,
                dataclasses.replace(
                    initial,
                    replay_ratio=rho,
                    requests_in_flight=in_flight,
                    learner_devices=learner,
                    generation_devices=total - learner,
                ),
            )
        )
    return out
