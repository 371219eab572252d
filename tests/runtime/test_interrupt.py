"""Ctrl-C in the RL loop (``runtime.interrupt.DeferredInterrupt``): the first SIGINT is
recorded and raised at ``check``; a second one interrupts at once."""

import os
import signal

import pytest

from jaxflash.runtime.interrupt import DeferredInterrupt, interrupted_message


def test_first_sigint_is_deferred_to_check_and_a_second_one_interrupts_at_once(capfd):
    before = signal.getsignal(signal.SIGINT)
    interrupt = DeferredInterrupt()
    interrupt.install()
    try:
        interrupt.check()  # nothing yet
        os.kill(os.getpid(), signal.SIGINT)  # handled between bytecodes, here
        assert interrupt.requested  # ... and nothing was raised
        assert "stopping at the next safe point" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second: at once
    finally:
        interrupt.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_restore_without_a_sigint_and_twice_is_harmless():
    before = signal.getsignal(signal.SIGINT)
    interrupt = DeferredInterrupt()
    interrupt.install()
    assert signal.getsignal(signal.SIGINT) is not before
    interrupt.restore()
    interrupt.restore()
    assert signal.getsignal(signal.SIGINT) is before and not interrupt.requested


def test_the_exit_line_names_the_step_a_resume_starts_from(tmp_path):
    """The launcher's last line after Ctrl-C is read from the checkpoint directory as
    the run left it (committed step directories ``N``, uncommitted ``N.orbax-checkpoint-
    tmp-*``; a real half-written one: tests/checkpoint/test_checkpoint.py)."""
    work = str(tmp_path)
    assert interrupted_message(work) == (
        f"interrupted: {work} has no complete checkpoint: running the same command again "
        "starts it from the beginning"
    )
    ckpt = tmp_path / "checkpoints"
    (ckpt / "1.orbax-checkpoint-tmp-1700000000").mkdir(parents=True)
    assert interrupted_message(work).startswith(
        "interrupted: the checkpoint of step 1 was being written and is abandoned; "
        f"{work} has no complete checkpoint"
    )
    for step in (2, 4):
        (ckpt / str(step)).mkdir()
    assert interrupted_message(work) == (
        f"interrupted: run the same command again to resume {work} from step 4, its last "
        "complete checkpoint"
    )
    assert interrupted_message(work, total_steps=5).startswith("interrupted: run the same")
    # Issue 31: a Ctrl-C during the final evaluation of a finished run promised a resume
    # "from step 4", and the rerun only said the run is finished, never evaluating it.
    line = interrupted_message(work, total_steps=4)
    assert line.startswith(f"interrupted: {work} is finished (its last step, 4, is saved)")
    assert "not scored" in line and "resume" not in line
