"""Config sections ``replay.*`` and ``controller.*``: the dual replay cycle and its scheduler.

One dataclass per concept, owned by the lower package: ``ReplaySpec`` is the buffer's
``replay.replay_config.ReplayConfig`` plus the cycle's own fields (ratio, advantages,
correction), ``ControllerSpec`` the controller's ``replay.controller.ControllerKnobs``
plus who sets rho (kind, schedules, elastic); no field or default is written twice.
Each validates its fields, naming them as the config does;
``check_replay_combination`` refuses, naming the fields, every combination whose
settings would be silently ignored (it runs in ``ExperimentConfig.__post_init__``,
before any model is loaded). The runtime builds the buffer, the composer and the
controller from them in ``runtime.control.replay_cycle``.

Sources: the replay cycle is ReFlow's (arXiv 2610.21640; only its abstract is
available), its caps Marin's, its samplers Arnal et al. (arXiv 2604.08706),
FreshPER (arXiv 2604.16918) and RePO (arXiv 2506.09340); the controller's rules
are documented in ``replay.controller``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxflash.algorithms.advantages import ADVANTAGE_ESTIMATORS
from jaxflash.algorithms.policy_loss import POLICY_LOSSES, PROXIMAL_LOSSES
from jaxflash.learner.config import LearnerConfig
from jaxflash.replay.controller import ControllerConfig, ControllerKnobs
from jaxflash.replay.dual_cycle import ADVANTAGE_MODES
from jaxflash.replay.replay_config import ReplayConfig
from jaxflash.runtime.config.specs import ConfigError, check

CONTROLLER_KINDS = ("none", "fixed", "adaptive")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplaySpec(ReplayConfig):
    """``replay.*``: the replay cycle mixed into every learner batch.

    Attributes:
      ratio: rho in [0, 1), the replayed share of each learner batch. 0 (default)
        is plain async: no buffer, exactly the loop without replay. With rho > 0
        the learner batch keeps ``rollout.prompts_per_step`` groups' worth of
        rows, of which round((1 - rho) * prompts_per_step) groups are fresh.
      capacity, max_age, max_reuse, sampler, recency_exponent, freshness_tau,
        freshness_base, prompt_strategy, drop_uniform_groups: the buffer's, inherited
        from ``replay.replay_config.ReplayConfig`` (fields a sampler would ignore
        must stay None). Its ``seed`` is not a config key: the buffer's RNG is seeded
        from the run's seed (``buffer_config``).
      advantages: "fixed" (stored at ingestion, Marin) | "joint" | "split" (RePO:
        need sampler="per_prompt").
      advantage_estimator: estimator "joint"/"split" recompute with (None there
        means "grpo"); must stay None with "fixed".
      correction: off-policy correction of the replayed rows, a ``POLICY_LOSSES``
        name: "decoupled_ppo" (PPO clipped against the proximal policy, weighted
        by pi_prox / mu; AReaL arXiv 2505.24298), "tis" (the same weight
        truncated), "m2po" (second-moment mask, arXiv 2510.01161), "cispo"
        (clipped, detached weight pi / mu; MiniMax-M1 arXiv 2506.13585) or "ppo"
        (clipped against mu, RePO arXiv 2506.09340). mu is always the behaviour
        logprobs stored with the trajectory; pi_old is the proximal policy for
        decoupled_ppo / tis and mu for the others. The fresh rows keep
        ``learner.loss``; both apply in the same jitted step
        (``learner.cycles``). None = ``learner.loss`` (and its ratio_against and
        kwargs) for the replayed rows too.
      correction_kwargs: hyper-parameters of ``correction`` (e.g. {"tis_cap": 2.0});
        only with a correction.
    """

    ratio: float = 0.0
    advantages: str = "fixed"
    advantage_estimator: str | None = None
    correction: str | None = None
    correction_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check(0.0 <= self.ratio < 1.0, f"replay.ratio must be in [0, 1), got {self.ratio}")
        check(
            self.advantages in ADVANTAGE_MODES,
            f"replay.advantages must be one of {ADVANTAGE_MODES}, got {self.advantages!r}",
        )
        check(
            self.advantage_estimator is None or self.advantage_estimator in ADVANTAGE_ESTIMATORS,
            f"replay.advantage_estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, "
            f"got {self.advantage_estimator!r}",
        )
        check(
            self.advantages != "fixed" or self.advantage_estimator is None,
            "replay.advantage_estimator would be ignored with replay.advantages='fixed' "
            "(nothing is recomputed); leave it unset or choose 'joint' / 'split'",
        )
        check(
            self.advantages == "fixed" or self.sampler == "per_prompt",
            f"replay.advantages={self.advantages!r} normalises each prompt's fresh and "
            f"replayed samples together or apart: it needs replay.sampler='per_prompt', "
            f"got {self.sampler!r}",
        )
        check(
            self.correction is None or self.correction in POLICY_LOSSES,
            f"replay.correction must be one of {sorted(POLICY_LOSSES)} (or unset = "
            f"learner.loss), got {self.correction!r}",
        )
        check(
            self.correction is not None or not self.correction_kwargs,
            f"replay.correction_kwargs={dict(self.correction_kwargs)} would be ignored without "
            "replay.correction",
        )
        if self.correction is not None:
            try:
                self.learner_fields(LearnerConfig())
            except ValueError as e:
                raise ConfigError(
                    str(e)
                    .replace("LearnerConfig.replay_loss_kwargs", "replay.correction_kwargs")
                    .replace("LearnerConfig.replay_loss", "replay.correction")
                ) from None
        try:
            super().__post_init__()  # the buffer's own checks
        except ValueError as e:
            raise ConfigError(str(e).replace("ReplayConfig.", "replay.")) from None

    def learner_fields(self, learner: LearnerConfig) -> LearnerConfig:
        """``learner`` with the replayed rows' loss set from ``correction`` (or its own).

        Returns:
          A LearnerConfig with ``replay_loss``, ``replay_loss_kwargs`` and
          ``replay_ratio_against``: the correction's (pi_old = the proximal policy
          for decoupled_ppo / tis, the stored behaviour logprobs otherwise), or,
          without a correction, the learner's own loss, kwargs and ratio_against.

        Raises:
          ValueError: kwargs the correction does not take (``LearnerConfig``).
        """
        if self.correction is None:
            return learner.replace(
                replay_loss=learner.loss,
                replay_loss_kwargs=dict(learner.loss_kwargs),
                replay_ratio_against=learner.ratio_against,
            )
        return learner.replace(
            replay_loss=self.correction,
            replay_loss_kwargs=dict(self.correction_kwargs),
            replay_ratio_against="proximal" if self.correction in PROXIMAL_LOSSES else "behaviour",
        )

    def buffer_config(self, *, seed: int) -> ReplayConfig:
        """The buffer's own ``ReplayConfig`` (these fields; its RNG seeded with ``seed``)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(ReplayConfig)}
        return ReplayConfig(**{**own, "seed": seed})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerSpec(ControllerKnobs):
    """``controller.*``: who sets the replay ratio each step.

    Attributes:
      kind: "none" (replay.ratio every step), "fixed" (``replay_schedule``, a
        ``FixedSchedule`` for ablations) or "adaptive" (``AdaptiveController``).
      replay_schedule: "fixed" only: "from_step:rho,..." e.g. "0:0.25,10:0.5"
        (the first from_step 0, the first rho equal to replay.ratio).
      max_replay_ratio, replay_step, ess_min, staleness_target, balance_margin,
        queue_high, smoothing, move_patience: "adaptive" only, inherited from
        ``replay.controller.ControllerKnobs``. Its alpha stays within
        rollout.async_ratio (the user's maximum).

      elastic: move devices between the learner and the generation slices when the
        decision's role split changes (``runtime.control.elastic``; "fixed" or "adaptive";
        disjoint thread placement only, checked by ``runtime.config.elastic_spec``).
        False (default): the split is only proposed (``ctl_proposed_*``).
      device_schedule: "fixed" with elastic only: "from_step:learner_devices,..."
        e.g. "0:6,2:7,4:6" (the first from_step 0, its size the mesh.learner
        device count). With it, replay_schedule may be empty (rho = replay.ratio).

    Applied in the live loop at the next step boundary (``runtime.control.replay_cycle``):
    the replay ratio (fresh groups per step and replayed samples), alpha (the
    staleness bound, within rollout.async_ratio) and the requests in flight (the
    scheduler's admission capacity); with ``elastic`` also the role split (whole
    generation slices move, ``sync.reshard_plan``). Without it the role split is
    only proposed (``ctl_proposed_*``).
    """

    kind: str = "none"
    replay_schedule: str = ""
    elastic: bool = False
    device_schedule: str = ""

    def __post_init__(self) -> None:
        check(
            self.kind in CONTROLLER_KINDS,
            f"controller.kind must be one of {CONTROLLER_KINDS}, got {self.kind!r}",
        )
        check(
            self.kind == "fixed" or not self.replay_schedule,
            f"controller.replay_schedule would be ignored with controller.kind={self.kind!r} "
            "(only 'fixed' reads it)",
        )
        check(
            not self.elastic or self.kind in ("fixed", "adaptive"),
            "controller.elastic=True needs controller.kind='fixed' (device_schedule) or "
            f"'adaptive' (a role split to apply), got {self.kind!r}",
        )
        check(
            not self.device_schedule or (self.kind == "fixed" and self.elastic),
            f"controller.device_schedule={self.device_schedule!r} would be ignored: it needs "
            "controller.kind='fixed' and controller.elastic=True",
        )
        if self.kind == "fixed":
            check(
                bool(self.replay_schedule or self.device_schedule),
                "controller.kind='fixed' needs controller.replay_schedule or "
                "controller.device_schedule",
            )
            self.schedule()  # parse errors now
            self.device_steps()
        if self.kind != "adaptive":
            own = ("kind", "replay_schedule", "elastic", "device_schedule")
            ignored = [
                f"controller.{f.name}"
                for f in dataclasses.fields(self)
                if f.name not in own and getattr(self, f.name) != f.default
            ]
            check(
                not ignored,
                f"{ignored} would be ignored with controller.kind={self.kind!r} (only "
                "'adaptive' reads them)",
            )
        else:
            try:
                self.controller_config(batch_samples=1, max_async_ratio=0)
            except ValueError as e:
                raise ConfigError(str(e).replace("ControllerConfig", "controller")) from None

    def schedule(self) -> list[tuple[int, float]]:
        """``replay_schedule`` parsed: [(from_step, rho)], from_step ascending, first 0
        ([] when only a device_schedule is given: rho stays replay.ratio)."""
        if not self.replay_schedule and self.device_schedule:
            return []
        pairs = _parse_schedule("replay_schedule", self.replay_schedule, "rho", float)
        bad = [r for _, r in pairs if not 0.0 <= r < 1.0]
        check(not bad, f"controller.replay_schedule ratios must be in [0, 1), got {bad}")
        return pairs

    def device_steps(self) -> list[tuple[int, int]]:
        """``device_schedule`` parsed: [(from_step, learner_devices)] ([] when unset)."""
        if not self.device_schedule:
            return []
        pairs = _parse_schedule("device_schedule", self.device_schedule, "learner_devices", int)
        bad = [n for _, n in pairs if n < 1]
        check(not bad, f"controller.device_schedule learner device counts must be >= 1, got {bad}")
        return pairs

    def controller_config(
        self, *, batch_samples: int, max_async_ratio: int, group_size: int = 1, **devices: int
    ) -> ControllerConfig:
        """The ``AdaptiveController``'s config for a run's batch, alpha maximum and G;
        ``devices``: its device_quantum / min_*_devices (an elastic run's slices)."""
        return ControllerConfig(
            **devices,
            batch_samples=batch_samples,
            max_async_ratio=max_async_ratio,
            group_size=group_size,
            **self.knobs(),
        )

    def max_ratio(self, replay: ReplaySpec) -> float:
        """The largest rho any step of the run can use."""
        return max(self.ratios(replay))

    def ratios(self, replay: ReplaySpec) -> list[float]:
        """Every rho a step of the run can use, ascending (sizes the learner batch).

        "none": replay.ratio; "fixed": the schedule's; "adaptive": the values the
        controller reaches from replay.ratio in steps of ``replay_step`` clipped to
        [0, max_replay_ratio] (``AdaptiveController.update``'s arithmetic, so the
        same floats).
        """
        if self.kind == "fixed":
            return sorted({r for _, r in self.schedule()} or {replay.ratio})
        if self.kind != "adaptive":
            return [replay.ratio]
        seen, todo = set(), [replay.ratio]
        while todo and len(seen) < 10_000:  # a finite set; the bound only guards floats
            r = todo.pop()
            if r in seen:
                continue
            seen.add(r)
            todo += [
                min(self.max_replay_ratio, r + self.replay_step),
                max(0.0, r - self.replay_step),
            ]
        return sorted(seen)


def _parse_schedule(field: str, text: str, what: str, cast: Any) -> list[tuple[int, Any]]:
    """ "from_step:value,..." -> [(from_step, value)], from_steps from 0, increasing."""
    pairs: list[tuple[int, Any]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        step, sep, value = part.partition(":")
        try:
            pairs.append((int(step), cast(value)))
        except ValueError:
            raise ConfigError(
                f"controller.{field} entry {part!r} is not 'from_step:{what}'"
            ) from None
        check(bool(sep), f"controller.{field} entry {part!r} is not 'from_step:{what}'")
    steps = [s for s, _ in pairs]
    check(
        bool(steps) and steps[0] == 0 and steps == sorted(set(steps)),
        f"controller.{field} needs from_steps starting at 0 and increasing, got {text!r}",
    )
    return pairs


def _default(f: dataclasses.Field) -> Any:
    """A dataclass field's default value (calling its default_factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def replay_active(replay: ReplaySpec, controller: ControllerSpec) -> bool:
    """Whether the run has a replay cycle at all (False: the plain loop, unchanged)."""
    return replay.ratio > 0 or controller.kind != "none"


def check_replay_learner(
    replay: ReplaySpec, controller: ControllerSpec, *, multi_process: bool
) -> None:
    """Refuse replay on a learner of several processes (not tested there: the batch
    with its ``cycle_bt`` is posted to every process, but no multi-process run with
    replay has been made).

    Raises:
      ConfigError: replay is active and ``multi_process`` (names replay.ratio and
        controller.kind).
    """
    if multi_process and replay_active(replay, controller):
        raise ConfigError(
            "replay.ratio / controller.kind: replay is not wired for a multi-process "
            "learner yet (run it with one learner process)"
        )


def check_replay_combination(
    replay: ReplaySpec, controller: ControllerSpec, *, async_ratio: int
) -> None:
    """Refuse settings that the other sections would make ignored (naming the fields).

    Raises:
      ConfigError: replay.* set while no replay happens (ratio 0, no controller);
        a fixed schedule whose first ratio is not replay.ratio; an adaptive
        controller whose max_replay_ratio is below replay.ratio; replay.max_age <=
        rollout.async_ratio (fresh samples arrive up to alpha versions old and are
        replayed at least one version later, so in steady state every one would be
        rejected for age and nothing replayed).
    """
    no_replay = controller.kind == "fixed" and controller.max_ratio(replay) == 0
    if not replay_active(replay, controller) or no_replay:
        ignored = [
            f"replay.{f.name}"
            for f in dataclasses.fields(replay)
            if getattr(replay, f.name) != _default(f)
        ]
        check(
            not ignored,
            f"{ignored} would be ignored: replay.ratio=0 with no replay schedule runs no "
            "replay cycle (set replay.ratio > 0, or a controller that replays)",
        )
    check(
        not replay_active(replay, controller) or no_replay or replay.max_age > async_ratio,
        f"replay.max_age={replay.max_age} <= rollout.async_ratio={async_ratio}: fresh "
        "samples arrive up to alpha versions old and a replay happens at least one version "
        "later, so the buffer would reject them for age and replay nothing; set "
        f"replay.max_age >= {async_ratio + 1}",
    )
    if controller.kind == "fixed" and controller.replay_schedule:
        check(
            controller.max_ratio(replay) > 0 or bool(controller.device_schedule),
            f"controller.replay_schedule={controller.replay_schedule!r} never replays (every "
            "rho is 0): the replay.* settings would be ignored; use controller.kind='none'",
        )
        first = controller.schedule()[0][1]
        check(
            first == replay.ratio,
            f"controller.replay_schedule starts at rho={first} but replay.ratio={replay.ratio}: "
            "one of them would be ignored (make them equal)",
        )
    if controller.kind == "adaptive":
        check(
            replay.ratio <= controller.max_replay_ratio,
            f"replay.ratio={replay.ratio} exceeds controller.max_replay_ratio="
            f"{controller.max_replay_ratio}",
        )
