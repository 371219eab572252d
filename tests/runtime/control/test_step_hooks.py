"""The run's hooks (``runtime.control.step_hooks.RunHooks``) on stand-in parts."""

import contextlib

from jaxflash.runtime.control.step_hooks import RunHooks


class _Console:
    def __init__(self):
        self.phases = []  # open phases, innermost last

    @contextlib.contextmanager
    def phase(self, label, status=None, *, announce=None):
        self.phases.append(label)
        yield
        self.phases.pop()

    def line(self, text):
        pass

    def background(self, label):
        pass


class _Learner:
    saved_step = 0

    def __init__(self, console):
        self.console, self.saves = console, []

    def save(self, meta):
        self.saves.append((meta, list(self.console.phases)))


class _Rollout:
    step_books = ({}, {"prompts_taken": 8}, 8, {})


class _Control:
    def checkpoint_state(self):
        return None, None


def test_a_save_is_a_phase_of_its_own_and_keeps_the_runs_clocks():
    # Issue 31's trial: a save of minutes printed "  step 1/20 (1 min 51 s)", no phase named.
    console = _Console()
    learner = _Learner(console)
    hooks = RunHooks(
        total_steps=20, eval_every=5, checkpoint_every=5, evaluate=lambda *a, **k: {},
        writer=None, console=console, learner=learner, control=_Control(), rollout=_Rollout(),
        interrupt=None, elapsed=lambda: "9 s", wall=lambda: {"run_s": 9.0, "trained_s": 4.0},
    )  # fmt: skip
    hooks.save_unsaved(1)
    [(meta, phases)] = learner.saves
    assert phases == ["step 1/20: saving the checkpoint"]
    assert meta.step == 1 and meta.extra["wall"] == {"run_s": 9.0, "trained_s": 4.0}
