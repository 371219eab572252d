"""The one RL loop end to end on the tiny smoke model (8 fake CPU devices), both placements.

* Colocated, α = 0 reproduces the previous synchronous loop prompt for prompt: the
  golden results in tests/data/sync_golden_smoke.json were recorded from it
  (``runtime.loop`` at commit 45e787d, before it became this loop's α = 0 case).
* α = 0 on disjoint slices reproduces the colocated run: same prompt ids, groups,
  training order, bit-equal tokens; losses to float32 rounding.
* α = 2 (configs/smoke_async.py): every trained sample has 0 <= staleness <= 2,
  rollouts.jsonl agrees, the counters add up, and a restart keeps the version and
  the counters, regenerates the prompts that were in flight and trains none twice.
* SIGTERM (one learner process) stops a run in its rollout wait or its evaluation,
  with the last trained step saved (the launcher's end-to-end case:
  tests/runtime/test_preemption_procs.py); so does a first Ctrl-C, and a step it lands in
  after the update is saved too.
* Empty batches: truncation=mask with every sample truncated runs to the end in
  both placements, each step skipped and counted.
"""

import io
import json
import os
import signal

import pytest

from configs import smoke, smoke_async
from jaxflash.metrics.reference import undocumented
from jaxflash.runtime import loop as rlvr
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.console import Console
from jaxflash.runtime.fleet.gen_server import GenerationServer
from jaxflash.runtime.interrupt import interrupted_message
from jaxflash.types import NothingTrainedError
from tests.paths import TESTS
from tests.report_fixtures import check_report_pngs

GOLDEN = os.path.join(TESTS, "data", "sync_golden_smoke.json")


def _rows(path):
    return [json.loads(x) for x in open(path)]


def _undocumented(metrics_rows):
    """Metric names a run wrote that the metrics reference (docs/METRICS.md) does not name."""
    return undocumented(metrics_rows)


@pytest.mark.parametrize(
    "decode_block,delta", [(1, False), (1, True), pytest.param(4, False, marks=pytest.mark.slow)]
)
@pytest.mark.timeout(900)
def test_colocated_alpha0_reproduces_the_previous_sync_loop(tmp_path, decode_block, delta):
    with open(GOLDEN) as f:
        golden = json.load(f)
    c = smoke.get_config()  # colocated: learner on 8 devices, one server on device 0
    c.total_steps = 3
    c.data.eval_size = 0
    # Delta publish (XOR + zstd of the changed bits, digest-checked): the same tokens.
    c.mesh.delta_publish = delta
    # Decoding 4 steps per dispatch changes when the host sees tokens, not which.
    c.rollout.decode_block = decode_block
    servers = []

    def factory(*args, **kwargs):
        servers.append(GenerationServer(*args, **kwargs))
        return servers[-1]

    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path), server_factory=factory)
    assert [s._batcher.decode_block for s in servers] == [decode_block]
    rows = _rows(tmp_path / "rollouts.jsonl")
    metrics = _rows(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for g, m in zip(golden["steps"], metrics, strict=True):
        step = g["step"]
        mine = {(r["prompt_id"], r["sample_index"]): r for r in rows if r["learner_step"] == step}
        assert sorted({k[0] for k in mine}) == g["prompt_ids"], step
        assert len(mine) == len(g["samples"])
        for s in g["samples"]:
            r = mine[(s["prompt_id"], s["sample_index"])]
            assert r["response_tokens"] == s["response_tokens"], (step, s["prompt_id"])
            assert r["reward"] == s["reward"] and r["finish_reason"] == s["finish_reason"]
            assert r["outcome"] == "trained" and r["staleness"] == 0
        assert m["tokens"] == g["tokens"], step
        # Same tokens and training order; logprob-derived values to float32 rounding.
        for key in ("loss", "pg_loss"):
            assert abs(m[key] - g[key]) <= 1e-6, (step, key, m[key], g[key])
        assert m["grad_norm"] == pytest.approx(g["grad_norm"], rel=1e-5), step
        assert m["entropy"] == pytest.approx(g["entropy"], rel=1e-5), step
        assert m["reward_mean"] == pytest.approx(g["reward_mean"], rel=1e-12), step
    assert not _undocumented(metrics)  # every metric is in the README's table
    if delta:  # versions 1-3 went as deltas, a fraction of the full tree's bytes
        assert all(0 < m["publish_changed_frac"] <= 1 for m in metrics)
        assert [m["publish_full_fallbacks"] for m in metrics] == [0, 0, 0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_alpha0_disjoint_slices_reproduce_the_sync_loop(tmp_path):
    c = smoke.get_config()
    c.total_steps = 2
    c.data.eval_size = 0
    c.mesh.learner.fsdp, c.mesh.learner.tensor = 2, 2  # same learner mesh in both runs
    sync_exp = ExperimentConfig.from_config_dict(c)
    c.mesh.colocated = False
    c.mesh.num_generation_slices = 2
    c.rollout.async_ratio = 0
    async_exp = ExperimentConfig.from_config_dict(c)

    rlvr.run(sync_exp, workdir=str(tmp_path / "sync"))
    rlvr.run(async_exp, workdir=str(tmp_path / "async"))

    def by_key(rows):
        return {(r["learner_step"], r["prompt_id"], r["sample_index"]): r for r in rows}

    s_rows, a_rows = (
        by_key(_rows(tmp_path / "sync/rollouts.jsonl")),
        by_key(_rows(tmp_path / "async/rollouts.jsonl")),
    )
    assert sorted(s_rows) == sorted(a_rows)
    assert {k[1] for k in s_rows} == set(range(8))  # 2 steps x 4 prompts
    for key, row in s_rows.items():
        assert a_rows[key]["response"] == row["response"], key
        assert a_rows[key]["reward"] == row["reward"], key
        assert a_rows[key]["start_version"] == row["start_version"] == key[0] - 1
    s_metrics = _rows(tmp_path / "sync/metrics.jsonl")
    a_metrics = _rows(tmp_path / "async/metrics.jsonl")
    assert [m["step"] for m in a_metrics] == [1, 2]
    for s, a in zip(s_metrics, a_metrics, strict=True):
        assert a["tokens"] == s["tokens"], s["step"]
        # Same tokens, same training order; the behaviour logprobs come from engines with
        # different slot counts (2 servers vs 1), whose matmuls may round the last bits
        # differently, so logprob-derived values agree to float32 rounding, not bit for bit.
        for key in ("loss", "pg_loss"):
            assert abs(a[key] - s[key]) <= 1e-6, (s["step"], key, a[key], s[key])
        assert a["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-5), s["step"]
        assert a["staleness_max"] == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_alpha2_staleness_bound_counters_and_resume(tmp_path):
    c = smoke_async.get_config()
    c.data.eval_size = 0
    c.total_steps = 3
    workdir = str(tmp_path / "run")
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=workdir)
    first = _rows(f"{workdir}/metrics.jsonl")
    assert [m["step"] for m in first] == [1, 2, 3]
    for m in first:
        assert 0 <= m["staleness_max"] <= 2
        assert sum(m["staleness_hist"].values()) == m["num_samples"] == 8
        closed = sum(m[f"prompts_{o}"] for o in ("trained", "filtered", "stale", "failed"))
        assert m["prompts_taken"] == closed + m["prompts_in_flight"]
        assert m["prompts_taken"] <= 3 * 4 + 4 * m["step"]  # (α+1)·B in flight at most
    assert not _undocumented(first)
    open_at_end = first[-1]["prompts_in_flight"]
    assert open_at_end > 0  # α = 2: prompts for later steps were in flight

    c.total_steps = 5  # resume in the same workdir
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=workdir)
    metrics = _rows(f"{workdir}/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    last = metrics[-1]
    assert last["policy_version"] == 5
    assert last["prompts_regenerated_on_resume"] == open_at_end
    assert last["prompts_trained"] == 5 * 4
    closed = sum(last[f"prompts_{o}"] for o in ("trained", "filtered", "stale", "failed"))
    assert last["prompts_taken"] == closed + last["prompts_in_flight"]
    trained = [r for r in _rows(f"{workdir}/rollouts.jsonl") if r["outcome"] == "trained"]
    assert all(0 <= r["staleness"] <= 2 for r in trained)
    keys = [(r["prompt_id"], r["sample_index"]) for r in trained]
    assert len(keys) == len(set(keys)) == 5 * 4 * 2  # nothing trained twice


@pytest.mark.timeout(600)
def test_async_smoke_restart_policy_two_steps(tmp_path):
    """The fast end-to-end check: α = 1, partial_rollout=restart, stale groups regenerated,
    on the paged KV cache (the dense engine's tokens, tests/generation/test_paged_engine.py), whose
    page counters reach the step metrics."""
    c = smoke_async.get_config()
    c.data.eval_size = 0
    c.total_steps = 2
    c.rollout.async_ratio = 1
    c.rollout.partial_rollout = "restart"
    c.rollout.stale_policy = "regenerate"
    c.rollout.kv_cache, c.rollout.page_size = "paged", 4  # the dense reservation's pages
    workdir = tmp_path / "run"
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(workdir))
    metrics = _rows(workdir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert not _undocumented(metrics)
    for m in metrics:
        assert 0 <= m["staleness_max"] <= 1
        assert m["prompts_trained"] == 4 * m["step"]
        assert m["prompts_taken"] <= (1 + 1) * 4 + 4 * m["step"]
        for key in ("gen0_version_lag", "gen1_version_lag", "weight_sync_s", "gen_idle_frac"):
            assert key in m
        # Pages: a pool as large as the dense reservation never runs out.
        assert 0 < m["gen_kv_cache_usage_peak"] <= 1 and 0 <= m["gen_kv_cache_usage"] <= 1
        assert m["gen_preemptions"] == m["gen_kv_page_waits"] == 0
        assert m["gen_prefix_cache_copied_pages"] == 0  # one device per server: one group
        # (Hits depend on a prompt's samples meeting on one server; counted in test_records.)
        assert m["gen_prefix_cache_hit_pages"] >= 0
    for r in _rows(workdir / "rollouts.jsonl"):
        # restart: a sample never mixes versions, and it starts where its tokens start.
        assert r["token_version_min"] == r["token_version_max"] == r["start_version"]
        assert r["outcome"] != "trained" or 0 <= r["staleness"] <= 1
    # The step timeline (timeline.jsonl) and the run report drawn from this run.
    timeline = _rows(workdir / "timeline.jsonl")
    assert [t["step"] for t in timeline] == [1, 2]
    for t in timeline:
        wait, train, publish = (t["learner"][k] for k in ("wait", "train", "publish"))
        assert wait[0] <= wait[1] <= train[0] <= train[1] <= publish[0] <= publish[1]
        assert len(t["gen"]) == 2 and all(a <= b for spans in t["gen"] for a, b in spans)
        assert all(a <= b for a, b in t["reward"])
    # Every scored sample's span lands in some step's row (spans are taken since the
    # previous step): with alpha = 1 a step's samples may all be scored in the step
    # before, so only the run's total is bounded (2 steps x 8 trained samples).
    assert sum(len(t["reward"]) for t in timeline) >= 8 * len(timeline)
    assert any(t["gen"][0] for t in timeline) and any(t["gen"][1] for t in timeline)
    check_report_pngs(str(workdir), {"curves", "staleness", "timeline"}, timeline_step=2)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.timeout(900)
def test_all_truncated_batches_are_skipped_and_the_run_goes_on(tmp_path, placement):
    # The random smoke model never emits EOS within 8 tokens: every sample is
    # truncated, and truncation=mask leaves every batch with nothing to train.
    c = smoke.get_config() if placement == "colocated" else smoke_async.get_config()
    c.total_steps = 2
    c.data.eval_size = 0
    c.rollout.truncation = "mask"
    c.rollout.async_ratio = 0 if placement == "colocated" else 1
    # Every step skipped: the run reaches its last step but trained nothing (exit 3).
    with pytest.raises(NothingTrainedError, match=r"'all_truncated': 2") as stopped:
        rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path))
    last = stopped.value.record
    metrics = _rows(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["skipped"] == "all_truncated"
        assert m["num_samples"] == 0 and m["samples_masked"] == 4 * 2 and m["truncated_frac"] == 1
        assert "loss" not in m and "grad_norm" not in m
    assert last["policy_version"] == 2
    assert last["steps_skipped"] == last["steps_skipped_all_truncated"] == 2
    assert not _undocumented(metrics)
    assert last["prompts_trained"] == 0
    assert last["prompt_outcomes"]["filtered"] == {"all_truncated": 2 * 4}
    closed = sum(last[f"prompts_{o}"] for o in ("trained", "filtered", "stale", "failed"))
    assert last["prompts_taken"] == closed + last["prompts_in_flight"]
    rows = _rows(tmp_path / "rollouts.jsonl")
    assert not [r for r in rows if r["outcome"] == "trained"]
    taken = [r for r in rows if r["outcome"] == "filtered"]
    assert len(taken) == 2 * 4 * 2
    assert all(r["loss_masked"] and r["reason"] == "all_truncated" for r in taken)


@pytest.mark.timeout(600)
def test_stop_after_ends_the_run_evaluated_and_checkpointed(tmp_path):
    # benchmarks/replay.py stops runs at a generation budget: the predicate sees each
    # step's metrics; the step it accepts is evaluated and saved like a last step.
    c = smoke.get_config()
    c.total_steps, c.eval.every, c.checkpoint.every = 6, 5, 5
    seen = []

    def stop(m):
        seen.append(m["samples_generated"])
        return m["samples_generated"] >= 16  # 2 steps of 4 prompts x 2 samples

    last = rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path), stop_after=stop)
    metrics = _rows(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2] and seen == [8, 16]
    assert "eval_accuracy" in metrics[-1] and "eval_accuracy" not in metrics[1]
    assert last["policy_version"] == 2
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]


class _SigtermOnVersion(GenerationServer):
    """A real server that sends this process SIGTERM at the first request it is handed
    after weights of version ``AT`` were published to it (α = 0: step AT + 1's first
    request; the server applies them later, in its own thread)."""

    AT, SIGNAL, armed, sent = 1, signal.SIGTERM, False, False

    def update_weights(self, params, version):
        super().update_weights(params, version)
        type(self).armed |= version >= self.AT

    def submit(self, request):
        if type(self).armed and not type(self).sent:
            type(self).sent = True
            os.kill(os.getpid(), self.SIGNAL)
        super().submit(request)


@pytest.mark.timeout(600)
def test_sigterm_while_generating_saves_the_last_trained_step_and_resumes(tmp_path):
    # A long rollout must not delay a preemption: the run stops in its wait, saves step 1
    # (not on disk: checkpoint.every is 100) and resumes there.
    c = smoke.get_config()
    c.total_steps, c.data.eval_size, c.checkpoint.every = 3, 0, 100
    exp = ExperimentConfig.from_config_dict(c)
    _SigtermOnVersion.armed = _SigtermOnVersion.sent = False
    handler, out = signal.getsignal(signal.SIGTERM), io.StringIO()
    last = rlvr.run(exp, workdir=str(tmp_path), server_factory=_SigtermOnVersion,
                    console=Console(out))  # fmt: skip
    assert _SigtermOnVersion.sent and signal.getsignal(signal.SIGTERM) is handler
    assert last["policy_version"] == 1
    assert [m["step"] for m in _rows(tmp_path / "metrics.jsonl")] == [1]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
    assert "preempted (SIGTERM): saved step 1" in out.getvalue()
    assert "finished" not in out.getvalue()
    out = io.StringIO()
    rlvr.run(exp, workdir=str(tmp_path), console=Console(out))
    assert "resumed from step 1" in out.getvalue() and "finished 3/3 steps" in out.getvalue()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2, 3]
    closed = sum(rows[-1][f"prompts_{o}"] for o in ("trained", "filtered", "stale", "failed"))
    assert rows[-1]["prompts_taken"] == closed + rows[-1]["prompts_in_flight"]


@pytest.mark.timeout(600)
def test_sigterm_during_evaluation_skips_it_and_saves_the_step(tmp_path):
    c = smoke.get_config()
    c.total_steps, c.eval.every, c.checkpoint.every = 3, 1, 100

    def sigterm(metrics):
        os.kill(os.getpid(), signal.SIGTERM)  # after step 1 trained, before its evaluation
        return False

    out = io.StringIO()
    exp = ExperimentConfig.from_config_dict(c)
    rlvr.run(exp, workdir=str(tmp_path), stop_after=sigterm, console=Console(out))
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in rows] == [0, 1]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" not in rows[1]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
    assert "preempted (SIGTERM): saved step 1" in out.getvalue()


class _SigintOnVersion(_SigtermOnVersion):
    """``_SigtermOnVersion`` with a Ctrl-C (SIGINT): sent at step AT + 1's first request."""

    SIGNAL, armed, sent = signal.SIGINT, False, False


@pytest.mark.timeout(600)
def test_ctrl_c_keeps_every_trained_step(tmp_path):
    # Issue 31: a Ctrl-C threw work away (a step trained after it, then left unsaved:
    # "no complete checkpoint"). Now it stops as SIGTERM does: in a wait, with the last
    # trained step saved; after an update, with that step saved. checkpoint.every is 100.
    c = smoke.get_config()
    c.total_steps, c.data.eval_size, c.checkpoint.every = 4, 0, 100
    exp, work = ExperimentConfig.from_config_dict(c), str(tmp_path)
    _SigintOnVersion.armed = _SigintOnVersion.sent = False
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):  # in step 2's generation
        rlvr.run(exp, workdir=work, server_factory=_SigintOnVersion)
    assert _SigintOnVersion.sent and signal.getsignal(signal.SIGINT) is handler
    assert [m["step"] for m in _rows(tmp_path / "metrics.jsonl")] == [1]
    assert interrupted_message(work).endswith(
        f"resume {work} from step 1, its last complete checkpoint"
    )

    def ctrl_c(metrics):  # step 2 trained and published, not yet saved
        os.kill(os.getpid(), signal.SIGINT)
        return False

    with pytest.raises(KeyboardInterrupt):
        rlvr.run(exp, workdir=work, stop_after=ctrl_c)
    assert signal.getsignal(signal.SIGINT) is handler
    assert [m["step"] for m in _rows(tmp_path / "metrics.jsonl")] == [1, 2]
    assert interrupted_message(work).endswith(
        f"resume {work} from step 2, its last complete checkpoint"
    )
