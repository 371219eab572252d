"""The step tracker and hooks (``metrics.tracker``): sections merged in row order, each
reported once; hooks run in order when due (``every=``, and at the last step)."""

import pytest

from jaxflash.metrics.tracker import SECTIONS, Hook, StepInfo, StepTracker, run_hooks


def test_record_lists_sections_in_row_order_whatever_order_they_arrive_in():
    tracker = StepTracker()
    tracker.report("time", {"step_time_s": 2.0})
    tracker.report("learner", {"loss": 0.5})
    tracker.report("batch", {"reward_mean": 1.0})
    tracker.report("version", policy_version=3)
    record = tracker.take()
    assert list(record) == ["reward_mean", "loss", "step_time_s", "policy_version"]
    assert tracker.take() == {}  # the next step starts empty


def test_a_later_section_wins_a_clash_and_bad_reports_fail():
    tracker = StepTracker()
    tracker.report("control", {"sched_async_ratio": 2})
    tracker.report("rollout", {"sched_async_ratio": 1, "prompts_taken": 4})
    assert tracker.take() == {"sched_async_ratio": 2, "prompts_taken": 4}
    assert SECTIONS.index("rollout") < SECTIONS.index("control")
    with pytest.raises(ValueError, match="unknown metrics section 'lerner'"):
        tracker.report("lerner", {})
    tracker.report("learner", {})
    with pytest.raises(ValueError, match="reported twice"):
        tracker.report("learner", {})


def test_hooks_run_in_order_on_their_cadence_and_at_the_last_step():
    ran = []
    hooks = [
        Hook(lambda info: ran.append(("eval", info.step)), every=3),
        Hook(lambda info: ran.append(("write", info.step))),
        Hook(lambda info: setattr(info, "last", info.last or info.step == 4)),  # a stop at 4
        Hook(lambda info: ran.append(("save", info.step)), every=5),
    ]
    for step in range(1, 7):
        run_hooks(hooks, StepInfo(step, {}, last=step == 6))
    assert [s for name, s in ran if name == "eval"] == [3, 6]
    assert [s for name, s in ran if name == "write"] == [1, 2, 3, 4, 5, 6]
    assert [s for name, s in ran if name == "save"] == [4, 5, 6]
    with pytest.raises(ValueError, match="every must be >= 1"):
        Hook(print, every=0)
