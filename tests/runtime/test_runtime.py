"""End-to-end runs of the loop on a tiny random model (real tokenizer), both placements.

Bad input must end as counted failures naming the input, never as a crash or a
silent drop: a malformed dataset row, a prompt longer than the limit, a reward
function that raises and one that hangs, a generation server that dies -- each
counted under its own reason in the colocated and the disjoint placement alike.
"""

import collections
import dataclasses
import json
import re

import pytest

from configs import smoke
from jaxflash.data.epochs import EpochShuffledRows
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.fleet.gen_server import GenerationServer
from jaxflash.runtime.loop import run
from jaxflash.types import NothingTrainedError, RunStoppedError


def _rows(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}),
        "{this is not json",
        json.dumps({"prompt": "What is 2 + 2?"}),  # no answer
        json.dumps({"prompt": "word " * 200, "answer": "4"}),  # over-long prompt
        json.dumps({"prompt": "What is 3 + 3?", "answer": "raise"}),
        json.dumps({"prompt": "What is 4 + 4?", "answer": "hang"}),
        json.dumps({"prompt": "What is 5 + 5?", "answer": "10"}),
        json.dumps({"prompt": "What is 6 + 6?", "answer": "12"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(tmp_path, total_steps=2, **overrides):
    c = smoke.get_config()
    c.total_steps = total_steps
    c.data.task = "file"
    c.data.path = str(_rows(tmp_path))
    c.data.eval_size = 0
    c.data.max_prompt_tokens = 48
    c.rollout.prompts_per_step = 8
    c.rollout.group_size = 2
    c.reward.fn = "tests.reward_fixtures:flaky_reward"
    c.reward.timeout_s = 2.0
    c.reward.num_workers = 2
    for key, value in overrides.items():
        section, field = key.split(".")
        c[section][field] = value
    return ExperimentConfig.from_config_dict(c)


@pytest.mark.parametrize(
    "colocated",
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["colocated", "disjoint"],
)
@pytest.mark.timeout(600)
def test_bad_input_is_counted_not_lost(tmp_path, caplog, colocated):
    workdir = tmp_path / "run"
    metrics = run(_config(tmp_path, **{"mesh.colocated": colocated}), workdir=str(workdir))
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    # Each step takes 8 prompts: 16 in all, none left in flight.
    assert last["prompts_taken"] == 16
    assert last["prompts_in_flight"] == 0
    assert (
        last["prompts_trained"]
        + last["prompts_failed"]
        + last["prompts_filtered"]
        + last["prompts_stale"]
        == 16
    )
    # Per epoch of 8 rows: malformed JSON, missing answer, over-long, raise, hang fail.
    assert last["prompts_failed"] == 10
    assert last["prompts_trained"] == 6
    assert last["prompt_outcomes"]["failed"] == {
        "malformed_row": 4,
        "prompt_too_long": 2,
        "reward_error": 2,
        "reward_timeout": 2,
    }
    # Every failed prompt has its G = 2 rows in rollouts.jsonl, those never generated
    # (malformed, over-long) or lost with their prompt included: the failed rows'
    # prompts are the ledger's failed prompts.
    rollouts = [json.loads(x) for x in open(workdir / "rollouts.jsonl")]
    failed = [r for r in rollouts if r["outcome"] == "failed"]
    per_prompt = collections.Counter(r["prompt_id"] for r in failed)
    assert len(per_prompt) == last["prompts_failed"] and set(per_prompt.values()) == {2}
    assert len({(r["prompt_id"], r["sample_index"]) for r in rollouts}) == len(rollouts)
    by_failure = collections.Counter(r["failure"] for r in failed)
    assert by_failure == {k: 2 * n for k, n in last["prompt_outcomes"]["failed"].items()}
    never = [r for r in failed if r["failure"] in ("malformed_row", "prompt_too_long")]
    assert all(r["response_tokens"] == [] and r["start_version"] is None for r in never)
    out = caplog.text
    assert "data.jsonl:2" in out and "bad JSON" in out  # names file and line
    assert "data.jsonl:3" in out and "answer" in out
    # over-long prompt: its id (the file is read in shuffled epochs) and the limit
    assert re.search(r"prompt \d+ is \d+ tokens, longer than max_prompt_tokens=48", out)
    assert "reward backend exploded" in out
    assert "timeout" in out
    assert metrics["policy_version"] == 2


@pytest.mark.timeout(600)
def test_a_run_whose_every_prompt_keeps_failing_stops(tmp_path):
    # A reward that raises on every sample would otherwise skip step after step and
    # finish "successfully" having trained nothing.
    path = tmp_path / "raise.jsonl"
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": "raise"}) for i in range(4)]
    path.write_text("\n".join(rows) + "\n")
    exp = _config(tmp_path, total_steps=10, **{"rollout.prompts_per_step": 2})
    exp = dataclasses.replace(exp, data=dataclasses.replace(exp.data, path=str(path)))
    workdir = tmp_path / "run"
    with pytest.raises(RunStoppedError, match=r"3 steps in a row had every prompt fail .*"
                       r"'reward_error': 6"):  # fmt: skip
        run(exp, workdir=str(workdir))
    steps = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    assert [(r["step"], r["skipped"]) for r in steps] == [(k, "all_failed") for k in (1, 2, 3)]


@pytest.mark.timeout(600)
def test_a_run_that_trained_no_step_says_so_and_fails(tmp_path, caplog):
    # Issue 31's trial: a reward that always raises skipped the one step (all_failed),
    # the evaluations' failures got no warning, and the run said "finished 1/1 steps"
    # and exited 0 with nothing trained (the launcher now exits 3).
    path = tmp_path / "raise.jsonl"
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": "raise"}) for i in range(20)]
    path.write_text("\n".join(rows) + "\n")
    exp = _config(tmp_path, total_steps=1, **{"rollout.prompts_per_step": 2, "data.eval_size": 2})
    exp = dataclasses.replace(exp, data=dataclasses.replace(exp.data, path=str(path)))
    with pytest.raises(NothingTrainedError, match=r"all 1 steps were skipped .*'all_failed': 1"):
        run(exp, workdir=str(tmp_path / "run"))
    for step in (0, 1):  # before training and at the last step: said, by reason (2 samples each)
        assert re.search(
            rf"evaluation at step {step}: 2 of 2 prompts failed .*'reward_error': 4", caplog.text
        ), caplog.text


@pytest.mark.timeout(600)
def test_eval_at_start_false_skips_the_evaluation_before_training(tmp_path):
    # Issue 31: eval.every=0 is refused, and the step-0 evaluation (4.5 min on HumanEval)
    # had no documented way out.
    path = tmp_path / "sums.jsonl"
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(20)]
    path.write_text("\n".join(rows) + "\n")
    overrides = {"rollout.prompts_per_step": 2, "data.eval_size": 2, "reward.fn": "math"}
    exp = _config(tmp_path, total_steps=1, **overrides)
    exp = dataclasses.replace(
        exp, data=dataclasses.replace(exp.data, path=str(path)),
        eval=dataclasses.replace(exp.eval, at_start=False),
    )  # fmt: skip
    workdir = tmp_path / "run"
    run(exp, workdir=str(workdir))
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1] and rows[0]["eval_prompts"] == 2  # the last step's


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_keeps_counters_and_cursor(tmp_path):
    workdir = str(tmp_path / "run")
    run(_config(tmp_path, **{"reward.fn": "math"}), workdir=workdir)
    first = [json.loads(x) for x in open(f"{workdir}/metrics.jsonl")]
    # Same workdir, more steps: resumes after step 2 with the ledger and data cursor.
    last = run(_config(tmp_path, total_steps=3, **{"reward.fn": "math"}), workdir=workdir)
    rows = [json.loads(x) for x in open(f"{workdir}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[:2] == first
    # The run's clock goes on from the checkpoint: trained_at_s never goes back (issue 31).
    wall = [r["trained_at_s"] for r in rows]
    assert wall == sorted(wall), wall
    assert last["prompts_taken"] == 24
    assert last["policy_version"] == 3
    rollouts = [json.loads(x) for x in open(f"{workdir}/rollouts.jsonl")]
    # The third step read cursors 16..23 (the file's third shuffled epoch): prompt ids
    # continue; file rows 1-3 (malformed, no answer, over-long) never reach generation
    # (their failed rows are empty).
    order = EpochShuffledRows(list(range(8)), _config(tmp_path).seed)
    expected = [c for c in range(16, 24) if order.index(c) not in (1, 2, 3)]
    step3 = [r for r in rollouts if r["learner_step"] == 3]
    generated = {r["prompt_id"] for r in step3 if r["response_tokens"]}
    assert sorted(generated) == expected
    never = {r["prompt_id"] for r in step3 if r["failure"] in ("malformed_row", "prompt_too_long")}
    assert sorted(generated | never) == list(range(16, 24))
    # The counters go on: the resumed step 3 reports what an uninterrupted run's does
    # (the group buffer's buffer_* restarted from 0 before they were checkpointed).
    straight = str(tmp_path / "straight")
    run(_config(tmp_path, total_steps=3, **{"reward.fn": "math"}), workdir=straight)
    row3 = [json.loads(x) for x in open(f"{straight}/metrics.jsonl")][2]
    books = ("buffer_", "prompts_", "samples_")
    keys = sorted(k for k in row3 if k.startswith(books) and k != "prompts_regenerated_on_resume")
    assert any(k.startswith("buffer_") for k in keys) and row3["buffer_produced"] > 8
    assert {k: rows[2].get(k) for k in keys} == {k: row3[k] for k in keys}


class _DiesOnPrompt(GenerationServer):
    """A real generation server that dies when it is handed prompt ``POISON``."""

    POISON = 15

    def submit(self, request):
        if request.prompt_id == self.POISON:
            self.dead = RuntimeError(f"{self.name}: device lost on prompt {request.prompt_id}")
        if getattr(self, "dead", None) is not None:
            raise self.dead
        super().submit(request)

    def check(self):
        if getattr(self, "dead", None) is not None:
            raise self.dead
        super().check()


@pytest.mark.slow
@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "disjoint"])
@pytest.mark.timeout(600)
def test_server_death_fails_the_prompts_in_flight_and_the_run_goes_on(tmp_path, colocated):
    """Step 2 admits prompts 8-15 in one pass; prompt 15 kills every server it reaches,
    so the ones in flight (8, 12, 13, 14, 15; 9-11 fail on their own first) fail
    SERVER_DIED, the step trains nothing and the run still ends normally. The file is
    read in file order (prompt id i = row i % 8) so that the prompt ids above are the
    rows the docstring names."""
    workdir = tmp_path / "run"
    exp = _config(tmp_path, **{"mesh.colocated": colocated, "data.shuffle": False})
    last = run(exp, workdir=str(workdir), server_factory=_DiesOnPrompt)
    assert last["policy_version"] == 2 and last["skipped"] == "all_failed"
    assert last["prompt_outcomes"]["failed"] == {
        "malformed_row": 4,
        "prompt_too_long": 2,
        "reward_error": 1,
        "reward_timeout": 1,
        "server_died": 5,
    }
    assert last["prompts_trained"] == 3 and last["prompts_taken"] == 16
    assert last["server_failures"] == (1 if colocated else 2)
