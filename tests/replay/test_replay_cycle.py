"""runtime.replay_cycle and runtime.replay_spec without a model: config refusals, the
mixed batch (fixed rows, labels, stored behaviour logprobs), the controller's decisions
as logged, and the state a checkpoint carries."""

import dataclasses
import json
import sys

import numpy as np
import pytest

from configs import replay_smoke, smoke
from jaxflash.replay.controller import AdaptiveController, ControllerInputs, Decision
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from jaxflash.runtime.config.replay_spec import ControllerSpec, ReplaySpec
from jaxflash.runtime.control.replay_cycle import ReplayCycle
from jaxflash.runtime.control.step_control import StepControl, StepReport
from jaxflash.runtime.workloads.learner_batch import LearnerBatch
from tests.replay_fixtures import make_group

# ----------------------------------------------------------------------------- config


def _exp(**overrides):
    c = smoke.get_config()
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(c, section), name, value)
    return ExperimentConfig.from_config_dict(c)


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"replay__max_age": 3}, ["replay.max_age"]),  # replay.* set while ratio = 0
        ({"replay__sampler": "recency", "replay__capacity": 8}, ["replay.capacity"]),
        ({"replay__ratio": 1.0}, ["replay.ratio"]),
        ({"replay__ratio": 0.5, "replay__correction": "no_such_loss"}, ["replay.correction"]),
        (  # kwargs of no correction would be ignored
            {"replay__ratio": 0.5, "replay__correction_kwargs": {"tis_cap": 2.0}},
            ["replay.correction_kwargs"],
        ),
        (  # a kwarg the correction does not take
            {
                "replay__ratio": 0.5,
                "replay__correction": "m2po",
                "replay__correction_kwargs": {"tis_cap": 2.0},
            },
            ["replay.correction_kwargs", "m2_threshold"],
        ),
        *(  # a kwarg of a wrong type or out of range: refused at config time, not at step 1
            (
                {
                    "replay__ratio": 0.5,
                    "replay__correction": "tis",
                    "replay__correction_kwargs": {"tis_cap": bad},
                },
                [f"replay.correction_kwargs.tis_cap must be {expected}, got {bad!r}"],
            )
            for bad, expected in ((-1.0, "a number > 0"), ("abc", "a finite number"))
        ),
        (
            {
                "replay__ratio": 0.5,
                "replay__correction": "decoupled_ppo",
                "replay__correction_kwargs": {"behaviour_cap": True},
            },
            ["replay.correction_kwargs.behaviour_cap must be a finite number or None, got True"],
        ),
        (
            {"learner__loss_kwargs": {"clip_eps_low": 1.5}},
            ["learner.loss_kwargs.clip_eps_low must be a number in [0, 1]"],
        ),
        ({"learner__replay_loss": "tis"}, ["learner.replay_loss"]),  # set from replay.*
        ({"replay__ratio": 0.5, "replay__advantages": "joint"}, ["replay.sampler"]),
        ({"replay__ratio": 0.5, "replay__freshness_tau": 2.0}, ["freshness_tau"]),
        ({"replay__ratio": 0.5, "replay__advantage_estimator": "rloo"}, ["advantage_estimator"]),
        ({"replay__ratio": 0.5, "controller__ess_min": 0.3}, ["controller.ess_min"]),
        ({"replay__ratio": 0.5, "controller__replay_schedule": "0:0.5"}, ["replay_schedule"]),
        (
            {"replay__ratio": 0.5, "controller__kind": "fixed", "controller__replay_schedule": ""},
            ["controller.replay_schedule"],
        ),
        (
            {
                "replay__ratio": 0.25,
                "controller__kind": "fixed",
                "controller__replay_schedule": "0:0.5",
            },
            ["controller.replay_schedule", "replay.ratio"],
        ),
        (
            {"replay__ratio": 0.9, "controller__kind": "adaptive"},
            ["replay.ratio", "controller.max_replay_ratio"],
        ),
        ({"controller__kind": "pid"}, ["controller.kind"]),
        (
            {"controller__kind": "fixed", "controller__replay_schedule": "0:0,5:0"},
            ["controller.replay_schedule"],
        ),
        (  # alpha = 2 samples arrive 2 versions old: max_age 2 could replay none of them
            {
                "replay__ratio": 0.5,
                "replay__max_age": 2,
                "rollout__async_ratio": 2,
                "mesh__colocated": False,
                "mesh__num_generation_slices": 2,
            },
            ["replay.max_age", "rollout.async_ratio"],
        ),
        ({"replay__rato": 0.5}, ["replay.ratio"]),  # unknown key: the nearest one named
    ],
)
def test_refused_combinations_name_the_fields(overrides, names):
    with pytest.raises(ConfigError) as e:
        _exp(**overrides)
    for name in names:
        assert name in str(e.value), (name, str(e.value))


def test_accepted_configs():
    assert _exp().replay.ratio == 0.0
    exp = ExperimentConfig.from_config_dict(replay_smoke.get_config())
    assert exp.replay.ratio == 0.5 and exp.controller.schedule() == [(0, 0.5)]
    a = _exp(replay__ratio=0.25, controller__kind="adaptive", controller__ess_min=0.3)
    assert a.controller.max_ratio(a.replay) == 0.75
    # rho = 0 with an adaptive controller is a replay run (rho may rise): replay.* allowed.
    _exp(controller__kind="adaptive", replay__max_age=2)


@pytest.mark.parametrize(
    "correction, kwargs, against",
    [("m2po", {"m2_threshold": 0.02}, "behaviour"), ("cispo", {}, "behaviour"),
     ("tis", {"tis_cap": 1.5}, "proximal"), ("decoupled_ppo", {}, "proximal")],
)  # fmt: skip
def test_replay_correction_sets_the_learners_replay_loss(correction, kwargs, against):
    exp = _exp(replay__ratio=0.5, replay__correction=correction, replay__correction_kwargs=kwargs)
    lc = exp.learner
    assert (lc.replay_loss, dict(lc.replay_loss_kwargs), lc.replay_ratio_against) == (
        correction,
        kwargs,
        against,
    )
    assert lc.loss == "ppo" and lc.dual_cycle  # the fresh rows keep learner.loss
    # No correction: the replayed rows take the learner's own loss (still per cycle).
    own = _exp(replay__ratio=0.5).learner
    assert own.replay_loss == own.loss and own.replay_ratio_against == own.ratio_against
    assert _exp().learner.replay_loss is None and not _exp().learner.dual_cycle
    # Derived again whenever the experiment is rebuilt (no stale replay loss survives).
    plain = dataclasses.replace(exp, replay=ReplaySpec(), controller=ControllerSpec())
    assert plain.learner.replay_loss is None


# ----------------------------------------------------------------------------- the batch


REPLAY = ReplaySpec(ratio=0.5, max_age=2, max_reuse=1, drop_uniform_groups=False)


def _cycle(replay=None, controller=None, state=None):
    return ReplayCycle(
        replay or REPLAY,
        controller or ControllerSpec(),
        batch_prompts=4,
        group_size=2,
        seed=0,
        state=state,
    )


def _control(replay=None, controller=None, state=None, **kw):
    return StepControl(
        replay or REPLAY,
        controller or ControllerSpec(),
        batch_prompts=4,
        group_size=2,
        async_ratio=0,
        learner_devices=6,
        generation_devices=2,
        state=state,
        **kw,
    )


def _after(control, row, next_version, move=None):
    """The step controller fed one metrics-like row (the loop builds the report from
    the values these names stand for); returns its ctl_* metrics."""
    report = StepReport(
        next_version=next_version,
        samples_generated=row["samples_generated"],
        step_s=row["step_time_s"],
        train_s=row["train_time_s"],
        trained_samples=row["sequences"],
        queue_samples=row["buffer_pending"] * 2,
        staleness_mean=row["staleness_mean"],
        replay_ess=row.get("replay_ess_token"),
    )
    return control.after_step(report, move=move).metrics


def _fresh(step: int) -> LearnerBatch:
    samples = tuple(
        s for p in range(2) for s in make_group(10 * step + p, [0.0, 1.0], start=step, length=4)
    )
    return LearnerBatch(None, samples, np.array([-1.0, 1.0] * 2, np.float32))


def test_mixed_batch_rows_labels_and_stored_behaviour_logprobs():
    cycle = _cycle()
    assert _control().fresh_prompts == 2 and cycle.rows == 8  # B=4 groups: 2 fresh + 4 replayed
    first, m1 = cycle.step_batch(_fresh(0), learner_version=0, pad_id=0, max_len=64)
    assert m1["cycle_replay_samples"] == 0 and m1["cycle_replay_shortfall"] == 4
    assert first.input_ids_bt.shape[0] == 8  # padded to the fixed row count
    batch, m = cycle.step_batch(_fresh(1), learner_version=1, pad_id=0, max_len=64)
    assert m["cycle_fresh_samples"] == 4 and m["cycle_replay_samples"] == 4
    assert m["replay_age_hist"] == [0, 4, 0] and m["replay_reuse_hist"] == [0, 4]
    # Replayed rows (4..7) carry the stored samples' behaviour logprobs and versions.
    stored = {(s.prompt_id, s.sample_index): s for s in _fresh(0).samples}
    mask = np.asarray(batch.loss_mask_bt) > 0
    for row in range(4, 8):
        versions = np.asarray(batch.token_versions_bt)[row][mask[row]]
        assert set(versions.tolist()) == {0}
        mu = np.asarray(batch.behaviour_logp_bt)[row][mask[row]]
        assert any(np.array_equal(mu, s.behaviour_logprobs) for s in stored.values())
    # Each row's cycle label rides in the batch (the learner picks the loss by it).
    np.testing.assert_array_equal(batch.cycle_bt[:, 0], [0] * 4 + [1] * 4)
    assert np.all(batch.cycle_bt == batch.cycle_bt[:, :1])  # constant along each row
    assert not np.any(first.cycle_bt)  # nothing replayed at step 0


def test_no_fresh_samples_no_batch():
    batch, m = _cycle().step_batch(
        LearnerBatch(None, (), np.zeros(0, np.float32)),
        learner_version=0,
        pad_id=0,
        max_len=64,
    )
    assert batch is None and m["cycle_fresh_samples"] == 0


# ----------------------------------------------------------------------------- controller


def _row(step, *, generated, step_s, train_s, pending, ess=None):
    row = {
        "samples_generated": generated,
        "step_time_s": step_s,
        "train_time_s": train_s,
        "sequences": 8,
        "buffer_pending": pending,
        "staleness_mean": 0.5,
    }
    if ess is not None:
        row["replay_ess_token"] = ess
    return row


def test_logged_decisions_are_the_controllers_and_resume_continues_them():
    spec = ControllerSpec(kind="adaptive", move_patience=2)
    replay = ReplaySpec(ratio=0.25, max_age=2)
    control = _control(replay=replay, controller=spec, samples_generated=100)
    # Slow generation (gen-bound) for 3 steps, then a flood (train-bound) for 3.
    rows = [_row(s, generated=100 + 2 * s, step_s=1.0, train_s=0.1, pending=0) for s in (1, 2, 3)]
    rows += [
        _row(s, generated=106 + 200 * (s - 3), step_s=1.0, train_s=1.0, pending=8, ess=0.9)
        for s in (4, 5, 6)
    ]
    logged = [_after(control, r, s + 1) for s, r in enumerate(rows)]
    assert all(json.dumps(m) for m in logged)  # metrics.jsonl-able
    # The same inputs fed to a controller told what was applied give the same decisions.
    ref = AdaptiveController(
        spec.controller_config(batch_samples=8, max_async_ratio=0, group_size=2),
        Decision(
            replay_ratio=0.25,
            async_ratio=0,
            requests_in_flight=0,
            learner_devices=6,
            generation_devices=2,
        ),
    )
    for m in logged:
        inputs = ControllerInputs(
            **{k[len("ctl_in_") :]: v for k, v in m.items() if k.startswith("ctl_in_")}
        )
        d = ref.update(inputs)
        assert m["ctl_replay_ratio"] == d.replay_ratio
        assert m["ctl_requests_in_flight"] == d.requests_in_flight
        assert m["ctl_proposed_generation_devices"] == d.generation_devices
        ref.applied(dataclasses.replace(d, learner_devices=6, generation_devices=2))
    # Documented direction: gen-bound raises rho and proposes a device for generation;
    # train-bound lowers rho and proposes one for the learner. Devices do not move in a
    # live run: the split in force stays 6 / 2.
    rho = [m["ctl_replay_ratio"] for m in logged]
    proposed = [m["ctl_proposed_generation_devices"] for m in logged]
    assert rho[:3] == [0.375, 0.5, 0.625] and rho[3:] == [0.5, 0.375, 0.25]
    assert proposed == [2, 3, 2, 2, 1, 2]
    assert all((m["ctl_learner_devices"], m["ctl_generation_devices"]) == (6, 2) for m in logged)
    assert logged[0]["ctl_in_gen_rate"] == pytest.approx(2.0)  # 102 - 100 in 1 s
    assert control.replay_ratio == rho[-1]  # the next step's rho
    # A skipped step (nothing trained) measures no training rate: no update, no row.
    skipped = dict(rows[-1], sequences=0)
    assert _after(control, skipped, 7) == {}
    assert control.replay_ratio == rho[-1]

    # A controller rebuilt from the checkpointed state continues with the same decisions.
    saved = json.loads(json.dumps(control.state_dict()))
    again = _control(replay=replay, controller=spec, state=saved, samples_generated=706)
    assert again.replay_ratio == control.replay_ratio
    nxt = _row(7, generated=720, step_s=1.0, train_s=0.5, pending=0, ess=0.8)
    assert _after(again, nxt, 8) == _after(control, nxt, 8)


def test_restored_cycle_draws_the_same_replay_batches():
    cycle = _cycle()
    for step in range(2):
        cycle.step_batch(_fresh(step), learner_version=step, pad_id=0, max_len=64)
    restored = _cycle(state=json.loads(json.dumps(cycle.state_dict())))
    for step in range(2, 5):
        a, ma = cycle.step_batch(_fresh(step), learner_version=step, pad_id=0, max_len=64)
        b, mb = restored.step_batch(_fresh(step), learner_version=step, pad_id=0, max_len=64)
        assert ma == mb
        for f in dataclasses.fields(a):
            np.testing.assert_array_equal(getattr(a, f.name), getattr(b, f.name))


def test_correction_kwargs_as_one_json_override_reach_the_learner(monkeypatch):
    """The README's command-line form of a mapping field: the whole mapping as JSON."""
    from absl import flags  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415

    argv = [
        "x",
        "--config=configs/replay_smoke.py",
        "--config.replay.correction=tis",
        '--config.replay.correction_kwargs={"tis_cap": 3.0}',
    ]
    monkeypatch.setattr(sys, "argv", argv)  # the config flag reads its overrides there
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", flag_values=values)
    values(argv)
    exp = ExperimentConfig.from_config_dict(holder.value)
    assert dict(exp.replay.correction_kwargs) == {"tis_cap": 3.0}
    assert dict(exp.learner.replay_loss_kwargs) == {"tis_cap": 3.0}
