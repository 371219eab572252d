"""SIGKILL the whole job at 20+ seeded points, restart it each time, compare with a run
that was never killed (``tests/kill_campaign.py`` runs the campaign).

Colocated (α = 0, deterministic on CPU): the killed-and-restarted run equals the
uninterrupted one step for step (prompts, sample indices, sampled tokens,
rewards, losses) and its books balance. Generation programs (disjoint slices, α =
1, a controller process with two generation processes): asynchronous, so not
bit-reproducible across restarts; it must still never train a prompt twice, lose
one, or leave a process behind.
"""

import os

import pytest

from tests.kill_campaign import (
    TIME,
    Job,
    check_books,
    draw_plan,
    rows,
    run_campaign,
    summary,
)

SEED = 20240611
B, G = 4, 2  # configs/smoke.py: prompts per step, samples per prompt


def _arrivals(point: str, remaining: int) -> int:
    """Arrivals at ``point`` before the last step's checkpoint commits, with ``remaining``
    steps to go: one per step, and for some points more (see jaxflash.failpoints)."""
    if point == "rollout_scored":
        return B * G * remaining  # every sample of the step's batch is scored first
    if point == "weight_transfer":
        return remaining + 1  # the weights are published at start too
    if point == "weight_send":
        return 2 * (remaining + 1)  # both generation programs pull every version
    if point == "checkpoint_committed":
        return remaining - 1  # (the last one would finish the run)
    return remaining


def _compare(run: str, reference: str) -> None:
    got = [r for r in rows(os.path.join(run, "metrics.jsonl")) if r["step"] > 0]
    want = [r for r in rows(os.path.join(reference, "metrics.jsonl")) if r["step"] > 0]
    for key in ("prompts_taken", "prompts_trained", "prompts_failed", "prompts_filtered",
                "loss", "pg_loss", "grad_norm", "reward_mean", "tokens"):  # fmt: skip
        assert [r[key] for r in got] == [r[key] for r in want], key

    def samples(workdir):
        return sorted(
            (r["learner_step"], r["prompt_id"], r["sample_index"], r["response"],
             tuple(r["response_tokens"]), r["reward"], r["outcome"])
            for r in rows(os.path.join(workdir, "rollouts.jsonl"))
        )  # fmt: skip

    assert samples(run) == samples(reference)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_sigkill_at_21_seeded_points_colocated_resumes_exactly(tmp_path):
    steps = 10
    # The largest n drawn per point; a kill at n commits about n - 1 steps first, so
    # small caps keep the kills spread over the run instead of piled at its end.
    caps = {
        "rollout_scored": 12, "rollouts_write": 2, "learner_step": 2, "weight_transfer": 2,
        "metrics_written": 2, "checkpoint_write": 2, "checkpoint_commit": 2,
        "checkpoint_committed": 1,
    }  # fmt: skip
    args = [f"--config.total_steps={steps}", "--config.data.eval_size=0"]
    cache = str(tmp_path / "jax_cache")
    reference = Job("smoke.py", args, str(tmp_path / "reference" / "run"), cache)
    done = reference.start(None)
    assert done.returncode == 0, done.log[-3000:]

    job = Job("smoke.py", args, str(tmp_path / "campaign" / "run"), cache)
    plan = draw_plan(
        SEED, caps, kills=17, time_kills=4, time_window_s=(1.0, 14.0), step_window_s=(0.0, 3.0)
    )
    assert plan[0].n == 1  # before the first checkpoint
    attempts = run_campaign(job, plan, steps, _arrivals)
    print(summary(attempts))
    kills = [a.kill for a in attempts if a.kill is not None]
    assert len(kills) >= 20
    assert {k.point for k in kills} >= set(caps) | {TIME}, "a failpoint never fired"

    _compare(job.workdir, reference.workdir)
    last = check_books(job.workdir, steps, G, max_in_flight=B)
    assert last["prompts_trained"] == steps * B and last["prompts_in_flight"] == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_campaign_with_generation_processes_loses_nothing(tmp_path):
    steps = 6
    caps = {"weight_send": 4, "checkpoint_commit": 2, "rollout_scored": 12}
    args = [
        f"--config.total_steps={steps}", "--config.data.eval_size=0",
        "--config.rollout.async_ratio=1", "--config.mesh.generation_processes=True",
    ]  # fmt: skip
    job = Job("smoke_async.py", args, str(tmp_path / "campaign" / "run"), str(tmp_path / "cache"))
    plan = draw_plan(
        # Time kills within the first 12 s of a start: without TensorFlow imports a
        # resumed start with the compile cache warm trained its 5 steps in < 22 s,
        # so a kill drawn at 21.9 s (old window 2-25 s) came after the run's end.
        SEED + 1, caps, kills=4, time_kills=2, time_window_s=(2.0, 12.0),
        step_window_s=(0.0, 3.0), each=1,
    )  # fmt: skip
    attempts = run_campaign(job, plan, steps, _arrivals)
    print(summary(attempts))
    kills = [a.kill for a in attempts if a.kill is not None]
    assert {k.point for k in kills} >= set(caps) | {TIME}, "a failpoint never fired"
    check_books(job.workdir, steps, G, max_in_flight=2 * B)  # α = 1
    regenerated = [
        int(line.split("; ")[1].split()[0])
        for a in attempts
        for line in a.log.splitlines()
        if line.startswith("resumed from step")
    ]
    print("prompts in flight at each resume:", regenerated)
    assert any(regenerated), "no resume had prompts in flight to generate again"
