"""workbench.run.stopping: SIGTERM and SIGHUP stop like Ctrl+C; a shutdown under way is not cut short."""

from __future__ import annotations

import os
import signal
import time

import pytest

from workbench.run.stopping import not_interrupted, stopped_by_signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_raises_keyboard_interrupt_and_the_handler_is_restored(signum):
    before = signal.getsignal(signum)
    with pytest.raises(KeyboardInterrupt), stopped_by_signals():
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # the handler runs at the next bytecode
    assert signal.getsignal(signum) is before


def test_a_signal_during_a_shutdown_waits_until_it_is_done():
    finished = False
    with pytest.raises(KeyboardInterrupt), stopped_by_signals():
        with not_interrupted():
            os.kill(os.getpid(), signal.SIGHUP)  # the terminal closes while the peers are stopped
            time.sleep(0.2)
            finished = True
        time.sleep(1.0)
    assert finished
