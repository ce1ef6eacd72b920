"""`Attempt.of`: the one way a probe turns an exception into data (cpdoctor/attempt.py)."""

from __future__ import annotations

import pytest

from cpdoctor.attempt import Attempt


def test_a_call_that_returns_keeps_its_value():
    done = Attempt.of(lambda: 42)
    assert done.ok and done.value == 42 and done.error is None and done.why() is None and done.or_else(0) == 42


def test_a_call_that_raises_keeps_the_exception_as_data():
    def boom() -> int:
        raise ValueError("ring_degree must divide\nsecond line")

    failed = Attempt.of(boom)
    assert not failed.ok and failed.value is None and isinstance(failed.error, ValueError)
    assert failed.why() == "ValueError: ring_degree must divide"
    assert failed.why(with_type=False) == "ring_degree must divide"
    assert failed.trace is None and failed.or_else(7) == 7
    traced = Attempt.of(boom, trace=True)
    assert traced.trace is not None and "Traceback" in traced.trace and "in boom" in traced.trace


def test_ctrl_c_is_not_data():
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Attempt.of(interrupted)
