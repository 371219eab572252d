"""One definition of each rollout row field and step metric, and the learner batch."""

import dataclasses
import json
import os
import re

import numpy as np
import pytest

from jaxflash.algorithms.advantages import get_advantage_estimator
from jaxflash.metrics.run_config import write_run_config
from jaxflash.replay.groups import DroppedGroup, Group
from jaxflash.runtime.console import step_line
from jaxflash.runtime.rollout.rows import ROLLOUT_FIELDS, rollout_row
from jaxflash.runtime.rollout.scoring import TruncationPolicy, correctness
from jaxflash.runtime.workloads.learner_batch import (
    batch_metrics,
    empty_reason,
    learner_batch,
    learner_metrics,
    staleness_metrics,
)
from jaxflash.types import FailureReason, FinishReason, Prompt, PromptOutcome, Sample
from tests.paths import REPO

README = os.path.join(REPO, "docs", "METRICS.md")


def _s(pid, idx, reward, *, n=3, truncated=False, versions=None, components=None):
    tv = np.full(n, 2, np.int32) if versions is None else np.asarray(versions, np.int32)
    s = Sample(
        prompt_id=pid,
        sample_index=idx,
        prompt_tokens=np.array([1, 2], np.int32),
        response_tokens=np.arange(5, 5 + tv.size, dtype=np.int32),
        behaviour_logprobs=np.zeros(tv.size, np.float32),
        token_versions=tv,
        start_version=int(tv.min()) if tv.size else 0,
        finish_reason=FinishReason.LENGTH if truncated else FinishReason.EOS,
        reward=reward,
        reward_info={"components": components or {}, "error": None},
    )
    s.response_text = "text"
    return s


def _group(pid, rewards, truncated=()):
    samples = tuple(_s(pid, i, r, truncated=i in truncated) for i, r in enumerate(rewards))
    return Group(prompt_id=pid, start_version=2, samples=samples)


def test_rollout_row_has_every_field_in_order():
    prompt = Prompt(prompt_id=4, text="What is 1+1?", prompt_tokens=np.array([1]), answer="2")
    s = _s(4, 1, 1.0, versions=[2, 3, 3], truncated=True, components={"math": 1.0})
    row = rollout_row(
        s,
        prompt,
        outcome="trained",
        reason="trained",
        learner_version=3,
        truncation=TruncationPolicy(mode="mask"),
    )
    assert tuple(row) == ROLLOUT_FIELDS
    assert (row["learner_step"], row["start_version"], row["staleness"]) == (4, 2, 1)
    assert (row["token_version_min"], row["token_version_max"]) == (2, 3)
    assert row["loss_masked"] is True and row["correct"] == 1.0 and row["failure"] is None
    assert row["prompt"] == "What is 1+1?" and row["response_tokens"] == [5, 6, 7]
    dropped = rollout_row(
        s,
        None,
        outcome="failed",
        reason="failed",
        learner_version=3,
        truncation=TruncationPolicy(),
        failure=FailureReason.REWARD_TIMEOUT,
    )
    assert dropped["failure"] == "reward_timeout" and dropped["loss_masked"] is True
    assert dropped["prompt"] == "" and dropped["answer"] == ""


def test_correctness_is_the_rewards_correct_component_else_its_score():
    # Math-Verify and reasoning-gym report "correct" (a partial-credit score is not).
    assert correctness(_s(0, 0, 0.05, components={"correct": 0.0, "answer_found": 1})) == 0.0
    assert correctness(_s(0, 0, 0.0, components={"correct": 1.0})) == 1.0
    # The built-in math reward with a format bonus: its Math-Verify part decides.
    both = {"math": 1.0, "math/correct": 1.0, "format_any": 1.0, "format_any/boxed": 1.0}
    assert correctness(_s(0, 0, 1.1, components=both)) == 1.0
    assert correctness(_s(0, 0, 0.1, components={**both, "math/correct": 0.0})) == 0.0
    # A custom reward without one: its own score (eval scores with that reward).
    assert correctness(_s(0, 0, 0.375, components={"uppercase_fraction": 0.375})) == 0.375
    assert correctness(_s(0, 0, 0.99)) == 0.99
    # Two parts that both claim correctness: ambiguous, so the score.
    two = {"a/correct": 1.0, "b/correct": 0.0}
    assert correctness(_s(0, 0, 0.5, components=two)) == 0.5


def test_batch_metrics_count_loss_samples_and_describe_all():
    groups = [_group(0, [1.0, 0.0], truncated={1}), _group(1, [0.5, 0.5])]
    trained = [groups[0].samples[0], *groups[1].samples]
    m = batch_metrics(groups, trained)
    assert (m["num_groups"], m["num_samples"], m["samples_masked"]) == (2, 3, 1)
    assert m["reward_mean"] == 0.5 and m["truncated_frac"] == 0.25
    # No "correct" component: accuracy is the mean reward, (1 + 0 + 0.5 + 0.5) / 4.
    assert m["accuracy"] == 0.5 and m["response_len_max"] == 3.0
    assert batch_metrics([], []) == {"num_groups": 0, "num_samples": 0, "samples_masked": 0}


def test_staleness_and_learner_metrics():
    m = staleness_metrics(np.array([0, 2, 2, 1]))
    assert m == {
        "staleness_mean": 1.25,
        "staleness_max": 2,
        "staleness_hist": {"0": 1, "1": 1, "2": 2},
    }
    assert staleness_metrics(np.array([], np.int64)) == {}
    train = {
        "loss": 1.0,
        "logprob_gap_max": 0.5,
        "logprob_gap_max_current": 1e-6,
        "logprob_gap_max_off_policy": 0.5,
        "current_tokens": 7.0,
    }
    assert learner_metrics(train) == {
        "loss": 1.0,
        "logprob_gap_on_policy_max": 1e-6,
        "logprob_gap_off_policy_max": 0.5,
        "on_policy_tokens": 7.0,
    }


def test_learner_batch_masks_truncated_samples_out_of_loss_and_baseline():
    grpo = get_advantage_estimator("grpo")
    groups = [_group(0, [1.0, 0.0, 1.0], truncated={2}), _group(1, [0.0, 0.0, 0.0])]
    lb = learner_batch(
        groups, grpo, TruncationPolicy(mode="mask"), pad_id=0, max_len=64, num_sequences=6
    )
    assert [(s.prompt_id, s.sample_index) for s in lb.samples] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    # Group 0's baseline is over its two unmasked samples [1, 0]: mean 0.5, std
    # (ddof 1) 1/sqrt(2), so +-1/sqrt(2); with the masked sample it would be +-0.577.
    np.testing.assert_allclose(lb.advantages[:2], [2**-0.5, -(2**-0.5)], atol=1e-5)
    np.testing.assert_array_equal(lb.advantages[2:], 0.0)
    assert int((np.asarray(lb.batch.loss_mask_bt).sum(axis=1) > 0).sum()) == 5
    empty = learner_batch(
        [_group(2, [1.0, 0.0], truncated={0, 1})],
        grpo,
        TruncationPolicy(mode="mask"),
        pad_id=0,
        max_len=64,
        num_sequences=2,
    )
    assert empty.batch is None and empty.samples == ()


def test_learner_batch_is_the_same_whatever_order_the_groups_completed_in():
    # Completion order depends on thread timing; float sums depend on row order, so
    # the batch is packed by prompt_id (a resumed run then matches bit for bit).
    grpo = get_advantage_estimator("grpo")
    groups = [_group(3, [1.0, 0.0]), _group(1, [0.0, 1.0]), _group(2, [1.0, 1.0])]
    kw = dict(pad_id=0, max_len=64, num_sequences=6)
    a = learner_batch(groups, grpo, TruncationPolicy(mode="none"), **kw)
    b = learner_batch(groups[::-1], grpo, TruncationPolicy(mode="none"), **kw)
    assert [s.prompt_id for s in a.samples] == [1, 1, 2, 2, 3, 3]
    assert [(s.prompt_id, s.sample_index) for s in a.samples] == [
        (s.prompt_id, s.sample_index) for s in b.samples
    ]
    np.testing.assert_array_equal(a.advantages, b.advantages)
    fields = [f.name for f in dataclasses.fields(a.batch)]
    assert "input_ids_bt" in fields
    for name in fields:
        np.testing.assert_array_equal(getattr(a.batch, name), getattr(b.batch, name), name)


def _dropped(pid, outcome):
    return DroppedGroup(prompt_id=pid, outcome=outcome, reason=str(outcome), detail="", samples=())


def test_empty_reason_names_what_emptied_the_step():
    assert empty_reason([_group(0, [1.0])], []) == "all_truncated"
    assert empty_reason([], [_dropped(0, PromptOutcome.FILTERED)] * 2) == "all_filtered"
    assert empty_reason([], [_dropped(0, PromptOutcome.STALE)]) == "all_stale"
    mixed = [_dropped(0, PromptOutcome.STALE), _dropped(1, PromptOutcome.FAILED)]
    assert empty_reason([], mixed) == "mixed"
    assert empty_reason([], []) == "no_prompts"


@pytest.mark.parametrize("name", ROLLOUT_FIELDS)
def test_readme_documents_every_rollout_field(name):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert re.search(rf"`{name}`", text), name


@pytest.mark.parametrize(
    "acc, err, shown",
    [
        (0.5, 0.1, "eval_accuracy 0.500 ± 0.100 (1 prompts)"),
        (0.5, "nan", "eval_accuracy 0.500 (1 prompts)"),  # one prompt: no standard error
        (0.5, float("nan"), "eval_accuracy 0.500 (1 prompts)"),
        ("nan", "nan", "eval_accuracy n/a (1 prompts)"),  # nothing scored
    ],
)
def test_step_line_eval_with_too_few_prompts_for_a_standard_error(acc, err, shown):
    # metrics.jsonl rows carry non-finite values as strings; the console line must not
    # crash on them (a held-out set of one prompt did).
    row = {"eval_accuracy": acc, "eval_accuracy_stderr": err, "eval_prompts": 1}
    assert step_line(0, 3, "1 s", row).endswith(shown)


class _Stops:
    ids = frozenset({2})
    sources = {2: ("eos",)}

    def describe(self, id_to_token):
        return "2 (</s>)"


class _Tok:
    stop_set = _Stops()

    def id_to_token(self, i):
        return "</s>"


@dataclasses.dataclass
class _Section:
    lr: float = 1e-3
    total_steps: int = 3


@dataclasses.dataclass
class _Exp:
    total_steps: int = 3
    learner: _Section = dataclasses.field(default_factory=_Section)


@dataclasses.dataclass
class _Lengths:
    longest: int = 9


def test_run_config_keeps_the_previous_settings_when_a_resume_changes_them(tmp_path, caplog):
    w = str(tmp_path)
    write_run_config(w, _Exp(), _Tok(), _Lengths())
    # Training further (total_steps) is the documented resume: no warning, no copy.
    write_run_config(w, _Exp(total_steps=6, learner=_Section(total_steps=6)), _Tok(), _Lengths())
    assert sorted(os.listdir(w)) == ["run_config.json"] and not caplog.records
    write_run_config(w, _Exp(learner=_Section(lr=0.5)), _Tok(), _Lengths())
    assert sorted(os.listdir(w)) == ["run_config.1.json", "run_config.json"]
    assert "learner.lr: 0.001 -> 0.5" in caplog.text and "run_config.1.json" in caplog.text
    kept = json.load(open(os.path.join(w, "run_config.1.json")))["experiment"]
    assert kept["learner"]["lr"] == 0.001 and kept["total_steps"] == 6
