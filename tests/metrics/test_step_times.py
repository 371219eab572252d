"""The run's clocks (``metrics.step_times.StepTimes``) go on across a resume."""

import pytest

from jaxflash.metrics.step_times import StepTimes
from jaxflash.runtime.resume import checkpoint_meta


class _Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


class _Rollout:
    first_request_at = None

    def take_timeline_spans(self):
        return {}


def _train_step(times, clock, rollout, *, start, first_request, trained):
    clock.t = start
    times.start()
    rollout.first_request_at = rollout.first_request_at or first_request
    with times.training():
        clock.t = trained
    return times.trained_at_s


def test_trained_at_and_elapsed_go_on_across_a_resume_instead_of_restarting_at_zero():
    clock, rollout = _Clock(100.0), _Rollout()
    times = StepTimes(clock, origin=100.0, rollout=rollout)
    first = _train_step(times, clock, rollout, start=105.0, first_request=110.0, trained=150.0)
    assert first == 40.0  # since the run's first request
    clock.t = 160.0
    saved = checkpoint_meta(1, ({}, {}, 0, {}), wall=times.wall_state()).extra["wall"]
    assert saved == {"run_s": 60.0, "trained_s": 50.0}
    # The resumed launch: another process, its clock far from the first one's.
    clock, rollout = _Clock(1000.0), _Rollout()
    times = StepTimes(clock, origin=1000.0, rollout=rollout, resumed=saved)
    second = _train_step(times, clock, rollout, start=1001.0, first_request=1020.0, trained=1030.0)
    assert second == 60.0 and second >= first  # 50 s before the save + 10 s now
    assert times.elapsed_s() == 90.0  # the console's elapsed: 60 + 30
    row = times.timeline(2)  # timeline rows share the run's clock too
    assert row["learner"]["train"] == [pytest.approx(61.0), pytest.approx(90.0)]
    # A checkpoint written before the clocks were kept resumes from 0, as before.
    fresh = StepTimes(_Clock(5.0), origin=5.0, rollout=_Rollout(), resumed={})
    assert fresh.elapsed_s() == 0.0
