"""Ctrl-C in the RL loop (``runtime.interrupt.DeferredInterrupt``): the first SIGINT is
recorded and raised at ``check``; a second one interrupts at once."""

import os
import signal

import pytest

from jaxflash.runtime.interrupt import DeferredInterrupt


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
