"""The record lane (csrc/rows.c's add_row) writes what Log._add_tensor's Python path writes.

Every case is recorded twice, into two fresh logs: once through the lane of
the implementation in use (``_native._impl``: the C extension, or with
``PICKLEHOOKS_NATIVE=0`` its Python twin, which declines everything), falling
back to ``Log._add_tensor`` where it declines, once with the lane switched off
(the Python path, with the same statistics). The rows, call numbers and
gradient bookkeeping must be the same; statistics must match float64 PyTorch;
values the lane declines must leave the log untouched.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from picklehooks import Log, _native, _ops
from picklehooks.capture import rows as rows_module

# The lane of the implementation in use, configured by the row-writing path on import (the twin's
# declines everything, so there Log._add_tensor itself goes without it: rows_module._add_row is None).
add_row, next_call = _native._impl.add_row, _native._impl.next_call
C = _native.AVAILABLE  # whether the lane is C's, which handles what the tests below call handled

STATS = _ops.VALUE | _ops.STATS
COPY = _ops.VALUE | _ops.TENSOR  # mode="tensor"


class Sub(torch.Tensor):
    pass


def handled_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "contiguous": base,
        "transposed": base.t(),
        "sliced": base[::2, 1:5],
        "expanded": torch.randn(1, 8, generator=g).expand(5, 8),
        "float64": base.double(),
        "float16": base.half(),
        "bfloat16": base.bfloat16(),
        "scalar": torch.tensor(3.5),
        "parameter": torch.nn.Parameter(base.clone()),
        "requires grad": base.clone().requires_grad_(),
        "with nan and inf": torch.tensor([1.0, float("nan"), float("inf"), 0.0]),
    }


def declined_values() -> dict[str, torch.Tensor]:
    z = torch.randn(4, dtype=torch.complex64)
    return {
        "empty": torch.empty(0, 3),
        "integer": torch.arange(6),
        "negative-bit view": z.conj().imag,
        "subclass": torch.randn(3).as_subclass(Sub),
        "meta": torch.empty(3, device="meta"),
        "sparse": torch.randn(3, 3).to_sparse(),
    }


def rows_of(log: Log) -> list[tuple]:
    return [(m, k, p, c, s, tuple(shape), dtype, stats, src, tensor, live)
            for m, k, p, c, s, shape, dtype, stats, src, tensor, live in log._rows]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and elements, NaN equal to NaN."""
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    except AssertionError:
        return False
    return True


def same_stats(a, b) -> bool:
    return a is b or (a is not None and b is not None and len(a) == len(b)
                      and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)))


def record_twice(monkeypatch, x: torch.Tensor, kind: str, flags: int, *, grad: bool = True, keep_graph: bool = False,
                 repeat: int = 2) -> tuple[Log, Log, bool]:
    """Record ``x`` ``repeat`` times into a log through the lane and into another without it."""
    with_lane, without = Log(keep_graph=keep_graph), Log(keep_graph=keep_graph)
    handled = None
    with torch.set_grad_enabled(grad):
        for _ in range(repeat):
            rows, calls = len(with_lane._rows), dict(with_lane._calls)
            took = add_row(with_lane, "m", kind, "0", x, flags)
            if not took:
                assert len(with_lane._rows) == rows and with_lane._calls == calls, \
                    "a declined value left a row or a call number behind"
                with_lane._add_tensor("m", kind, "0", x, flags)
            handled = took if handled is None else handled
            with monkeypatch.context() as patch:
                patch.setattr(rows_module, "_add_row", None)
                without._add_tensor("m", kind, "0", x, flags)
    return with_lane, without, handled


def assert_same_logs(a: Log, b: Log) -> None:
    ra, rb = rows_of(a), rows_of(b)
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert x[:7] == y[:7] and same_stats(x[7], y[7]), (x, y)
        assert (x[8] is None) == (y[8] is None) and (x[9] is None) == (y[9] is None) and x[10] is y[10]
        if x[9] is not None:  # kept copies: the same values, layout and grad state, each its own memory
            assert same_values(x[9], y[9]) and x[9].is_contiguous() and not x[9].requires_grad
            assert x[9].untyped_storage().data_ptr() != y[9].untyped_storage().data_ptr()
    assert a._calls == b._calls and a._awaiting_grad == b._awaiting_grad and a._maybe_grad == b._maybe_grad
    assert a._tensor_bytes == b._tensor_bytes


@pytest.mark.parametrize("kind", ["output", "input", "param", "grad_output"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad mode", "no_grad"])
@pytest.mark.parametrize("name", list(handled_values()))
def test_handled_values_give_the_python_paths_rows(monkeypatch, name, grad, kind):
    x = handled_values()[name]
    a, b, handled = record_twice(monkeypatch, x, kind, STATS, grad=grad)
    assert handled is C
    assert_same_logs(a, b)
    assert [row[3] for row in a._rows] == [0, 1] or kind == "grad_output"
    ref = x.detach().to(torch.float64)
    stats = a.records[0].stats  # the C pass's, or (the twin) PyTorch's, reduced when read
    finite = ref[torch.isfinite(ref)]
    if finite.numel() == ref.numel():
        want = [ref.mean().item(), ref.std(correction=0).item(), ref.min().item(), ref.max().item()]
        got = [stats[name] for name in ("mean", "std", "min", "max")]
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    else:
        assert math.isnan(stats["mean"]) and stats["n_nan"] == torch.isnan(ref).sum().item()
        assert stats["n_inf"] == torch.isinf(ref).sum().item()


# Statistics decline all of these; a copy declines only what isn't a strided tensor of a plain type.
@pytest.mark.parametrize("name, flags", [*((name, STATS) for name in declined_values()),
                                         ("subclass", COPY), ("sparse", COPY)])
def test_declined_values_go_to_the_python_path(monkeypatch, name, flags):
    x = declined_values()[name]
    if name in ("meta", "sparse"):  # the lane declines; what the Python path does is not this file's subject
        log = Log()
        assert add_row(log, "m", "output", "0", x, flags) is False
        assert not log._rows and not log._calls
        return
    a, b, handled = record_twice(monkeypatch, x, "output", flags)
    assert handled is False
    assert_same_logs(a, b)
    # What the Python path recorded reads back as PyTorch computes it.
    rec = a.records[0]
    if flags == STATS and x.numel() and x.is_floating_point():
        assert rec.stats["max"] == pytest.approx(x.detach().double().max().item())


@pytest.mark.parametrize("kind", ["output", "input", "param"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad mode", "no_grad"])
@pytest.mark.parametrize("name", [*handled_values(), "integer"])
def test_copies_give_the_python_paths_rows(monkeypatch, name, grad, kind):
    """mode="tensor": the lane keeps a detached contiguous copy of any strided tensor, as the Python path does."""
    x = {**handled_values(), "integer": torch.arange(12).reshape(3, 4)}[name]
    a, b, handled = record_twice(monkeypatch, x, kind, COPY, grad=grad)
    assert handled is C
    assert_same_logs(a, b)
    for row in a._rows:
        assert same_values(row[9], x.detach()) and row[9].data_ptr() != x.data_ptr()
    assert a._tensor_bytes == 2 * x.numel() * x.element_size()


def test_a_copy_does_not_follow_later_changes():
    """The copy is taken when recorded: an in-place change of the value afterwards doesn't reach it."""
    x = torch.randn(4, 5)
    log = Log()
    assert add_row(log, "m", "output", "", x, COPY) or log._add_tensor("m", "output", "", x, COPY) is None
    before = x.clone()
    x.mul_(2)
    assert torch.equal(log.records[0].tensor, before)


@pytest.mark.parametrize("flags, keep_graph", [
    (STATS | _ops.TENSOR, False),  # mode="both": keeps a copy too
    (STATS, True),  # record(keep_graph=True) keeps the live value
    (COPY, True),
])
def test_other_records_go_to_the_python_path(monkeypatch, flags, keep_graph):
    x = torch.randn(4, 5, requires_grad=True)
    a, b, handled = record_twice(monkeypatch, x, "output", flags, keep_graph=keep_graph)
    assert handled is False
    assert_same_logs(a, b)


@pytest.mark.parametrize("bit, waiting", [(_ops.GRAD_SURE, "sure"), (_ops.GRAD_NONE, None)])
@pytest.mark.parametrize("store", [STATS, COPY], ids=["stats", "copy"])
@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("grad", [True, False], ids=["grad mode", "no_grad"])
def test_the_gradient_bits_decide_the_pairing(monkeypatch, bit, waiting, store, requires_grad, grad):
    """GRAD_SURE / GRAD_NONE (set by tracing, and by the eager hooks for a value that requires grad, as
    they hook its gradient or not) decide what waits for a gradient, whatever the tensor and grad mode
    say: in the lane as in Python."""
    x = torch.randn(4, 5, requires_grad=requires_grad)
    a, b, handled = record_twice(monkeypatch, x, "output", store | bit, grad=grad)
    assert handled is C
    assert_same_logs(a, b)
    key = ("m", "output", "0")
    assert a._awaiting_grad == ({key: [0, 1]} if waiting == "sure" else {})
    assert a._maybe_grad == {}


def test_an_error_in_numbering_propagates():
    """A failure past the checks is the caller's to see, not a silent 'not handled' (through the
    lane, or the Python path where it declines)."""
    class Broken(Log):
        def _invocation(self, *args):
            raise KeyError("broken numbering")

    broken = Broken()
    broken._open["m"] = []  # outputs pair with invocations: _invocation is asked
    with pytest.raises(KeyError, match="broken numbering"):
        add_row(broken, "m", "output", "0", torch.randn(3), STATS) or broken._add_tensor("m", "output", "0",
                                                                                         torch.randn(3), STATS)
    assert not broken._rows
    if C:  # (in Python, the same log fails in _next_call's own way)
        replaced = Log()
        replaced._calls = []
        with pytest.raises(TypeError, match="_calls is not a dict"):
            add_row(replaced, "m", "output", "0", torch.randn(3), STATS)


# -- numbering: the lane's next_call (C, or the twin's) against Log._next_call (Python) --------------

KINDS = ["input", "output", "grad_input", "grad_output", "param", "param_grad", "buffer"]
EXPECT = [0, rows_module._SURE, rows_module._MAYBE]
numbering_ops = st.lists(st.tuples(st.sampled_from(["m", "n"]), st.sampled_from(KINDS),
                                   st.sampled_from(["", "0", "1"]), st.sampled_from(EXPECT)), max_size=80)


def numbering_state(log: Log) -> tuple:
    return (log._calls, log._open, log._closing, log._awaiting_grad, log._maybe_grad)


@given(numbering_ops)
@settings(max_examples=300, deadline=None)
def test_next_call_numbers_as_the_python_method_does(ops):
    """Any sequence of records (inputs opening invocations, outputs closing them, gradients popping
    the calls awaiting one) gets the same call numbers and leaves the same state either way."""
    c_log, py_log = Log(), Log()
    for module, kind, path, expect in ops:
        got = next_call(c_log, module, kind, path, expect)
        want = py_log._next_call(module, kind, path, expect)
        assert got == want and type(got) is int
        assert numbering_state(c_log) == numbering_state(py_log)


def test_next_call_trims_calls_that_may_never_get_a_gradient():
    """Inference loops under no_grad: a MAYBE list is cut back to its last calls, as in Python."""
    c_log, py_log = Log(), Log()
    for _ in range(rows_module._MAYBE_TRIM + 5):
        for log, number in ((c_log, next_call), (py_log, Log._next_call)):
            number(log, "m", "output", "", rows_module._MAYBE)
            number(log, "m", "param", "w", rows_module._SURE)  # SURE lists are never cut
    assert numbering_state(c_log) == numbering_state(py_log)
    assert len(c_log._maybe_grad[("m", "output", "")]) <= rows_module._MAYBE_TRIM
    assert len(c_log._awaiting_grad[("m", "param", "w")]) == rows_module._MAYBE_TRIM + 5


def test_the_lane_is_off_with_the_extensions():
    """PICKLEHOOKS_NATIVE=0 turns the lane off with the statistics (in a fresh process: it's read at import)."""
    import os
    import subprocess
    import sys

    code = "import picklehooks.capture.rows as r, picklehooks._native as n; print(r._add_row, n.AVAILABLE)"
    built = _native._speedups is not None
    for value, want in (("0", "None False"),
                        ("1", "<built-in function add_row> True" if built else "None False")):
        env = {**os.environ, "PICKLEHOOKS_NATIVE": value}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == want
