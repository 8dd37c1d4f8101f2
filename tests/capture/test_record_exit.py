"""``record()`` is exception-safe: however its block is left, nothing keeps recording and nothing errs at exit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks import _state
from tests.testutils import REPO


def model() -> nn.Module:
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    picklehooks.instrument(m)
    return m


def nothing_records() -> bool:
    return _state.active() is None and not _state._ANYWHERE


def test_an_exception_in_the_block_stops_recording():
    m = model()
    with pytest.raises(ZeroDivisionError):
        with picklehooks.record() as log:
            m(torch.randn(2, 3))
            1 / 0
    assert nothing_records()
    n = len(log)
    m(torch.randn(2, 3))
    assert len(log) == n > 0


def test_a_guard_stop_stops_recording_and_is_recorded():
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    picklehooks.instrument(m, on_nonfinite="raise")
    x = torch.randn(2, 3)
    x[0, 1] = float("nan")
    with pytest.raises(picklehooks.NonfiniteError) as info:
        with picklehooks.record(step=4) as log:
            m(x)
    assert nothing_records()
    bad = log.records[-1]
    assert (bad.module, bad.kind, bad.step) == ("0", "output", 4) == (info.value.module, info.value.kind,
                                                                     info.value.step)
    assert bad.stats["n_nan"] == info.value.nan == int(torch.isnan(nn.functional.linear(x, m[0].weight, m[0].bias)).sum())


def test_closing_a_generator_that_records_stops_recording():
    m = model()

    def steps():
        with picklehooks.record() as log:
            while True:
                m(torch.randn(2, 3))
                yield log

    gen = steps()
    next(gen)
    assert not nothing_records()
    gen.close()
    assert nothing_records()


def test_entered_by_hand_and_left_once():
    recording = picklehooks.record()
    log = recording.__enter__()
    with pytest.raises(picklehooks.PicklehooksError, match="active already"):
        recording.__enter__()
    recording.__exit__(None, None, None)
    recording.__exit__(None, None, None)  # a second exit (a callback's cleanup after a finally) does nothing
    assert nothing_records() and not recording.active and recording.log is log


@pytest.mark.parametrize("how", ["cycle", "global"])
def test_a_recording_never_left_is_silent_at_interpreter_exit(how):
    """A callback that entered record() and died mid-run: the interpreter exits with nothing said."""
    code = f"""
import torch, picklehooks
m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
picklehooks.instrument(m)
class Callback:
    def begin(self):
        self.recording = picklehooks.record(sink=None)
        self.log = self.recording.__enter__()
cb = Callback()
cb.begin()
m(torch.randn(1, 2)).sum().backward()
if {how!r} == "cycle":
    cb.me = cb        # collected by the last garbage collection, after modules are cleared
    del cb
print(len(picklehooks.Log.__mro__))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
