"""SIGTERM as Ctrl-C for ``autoprec search`` (autoprec.cli.interrupt), a lost raise included."""

from __future__ import annotations

import os
import signal
import time

import pytest

from autoprec.cli.interrupt import raise_if_terminated, terminate_as_interrupt


def _sigterm_swallowed() -> None:
    """A SIGTERM whose KeyboardInterrupt lands where it is swallowed, as in a garbage
    collector's callback ("Exception ignored in ...")."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs at the next bytecode
    except KeyboardInterrupt:
        return
    raise AssertionError("SIGTERM did not raise KeyboardInterrupt")


def test_a_lost_sigterm_is_raised_again_once():
    with terminate_as_interrupt():
        raise_if_terminated()  # nothing asked yet
        _sigterm_swallowed()
        with pytest.raises(KeyboardInterrupt):
            raise_if_terminated()
        raise_if_terminated()  # once per signal


def test_outside_the_block_sigterm_is_the_previous_handler_and_nothing_is_pending():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *_: seen.append(1))
    try:
        with terminate_as_interrupt():
            _sigterm_swallowed()
        raise_if_terminated()  # the block's end forgot it
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert seen == [1]
    finally:
        signal.signal(signal.SIGTERM, previous)
