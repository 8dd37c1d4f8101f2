"""The ``active`` op's C kernel (``csrc/kernels.c``), registered through libtorch's stable C shim.

Every hook of a scripted instrumented model asks ``picklehooks::active`` first; with
``picklehooks._speedups`` built and on it answers in C, and it must answer what the Python
kernel would: whether any log records, anywhere in the process. The Python twin has no
kernel (``PICKLEHOOKS_NATIVE=0``): the op keeps its Python one.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import picklehooks
from picklehooks import _native, _ops
from tests.testutils import recording_in_another_thread, run_fresh

active = torch.ops.picklehooks.active.default


def _kernel_origin() -> str:
    """Where the dispatcher says ``active``'s kernel was registered."""
    dump = torch._C._dispatch_dump("picklehooks::active")
    (line,) = [line for line in dump.splitlines() if line.startswith("CompositeExplicitAutograd")]
    return line


def test_the_kernel_is_the_c_one_where_the_extension_is_on():
    """C where the extension is on, Python with the twin (whose ACTIVE is no kernel)."""
    if _native.AVAILABLE:
        assert "csrc/kernels.c" in _kernel_origin()
    else:
        assert _native._twin.ACTIVE == 0 and "_ops.py" in _kernel_origin()


def test_the_twin_registers_nothing(monkeypatch):
    """With the twin, register_active is False and set_recording tells no kernel: _ops keeps its Python one."""
    monkeypatch.setattr(_native, "_impl", _native._twin)
    handles = list(_native._LIBRARY_HANDLES)
    assert _native.register_active("picklehooks_test_twin", "CompositeExplicitAutograd") is False
    assert _native._LIBRARY_HANDLES == handles
    _native.set_recording(True)
    assert active(0) is False  # the op's kernel, whichever it is, didn't hear it


def test_without_the_shims_functions_nothing_is_registered(monkeypatch):
    """A torch whose libtorch lacks aoti_torch_library_impl: False, so _ops registers the Python kernel."""
    monkeypatch.setattr(_native, "_library_functions", lambda: None)
    handles = list(_native._LIBRARY_HANDLES)
    assert _native.register_active("picklehooks_test_none", "CompositeExplicitAutograd") is False
    assert _native._LIBRARY_HANDLES == handles


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_shim_is_looked_up_only_in_the_libtorch_already_loaded(tmp_path, monkeypatch):
    """A libtorch_cpu beside a torch.__file__ that this process didn't load is not loaded (RTLD_NOLOAD):
    a second libtorch would have a dispatcher of its own."""
    import shutil
    import types

    import _ctypes  # any shared object will do: it must only never get loaded

    if not getattr(_ctypes, "__file__", None):
        pytest.skip("_ctypes is built into this Python")
    lib = tmp_path / "lib"
    lib.mkdir()
    stranger = lib / "libtorch_cpu.so"
    shutil.copy(_ctypes.__file__, stranger)
    monkeypatch.setattr(_native, "torch", types.SimpleNamespace(__file__=str(tmp_path / "__init__.py")))
    assert _native._library_functions() is None
    with open("/proc/self/maps") as maps:
        assert str(stranger) not in maps.read()


@pytest.mark.skipif(not _native.AVAILABLE, reason="picklehooks._speedups is not built here, or PICKLEHOOKS_NATIVE=0")
def test_the_c_kernel_answers_what_set_recording_said():
    """The kernel's contract, on an op of its own: it answers the last set_recording, in any thread."""
    lib = torch.library.Library("picklehooks_test_kernel", "DEF")
    lib.define("active(int flags) -> bool")
    handles = len(_native._LIBRARY_HANDLES)
    assert _native.register_active("picklehooks_test_kernel", "CompositeExplicitAutograd") is True
    assert len(_native._LIBRARY_HANDLES) == handles + 1  # kept: freeing it would drop the kernel
    op = torch.ops.picklehooks_test_kernel.active.default
    try:
        for flag in (True, False, True):
            _native.set_recording(flag)
            seen = []
            thread = threading.Thread(target=lambda: seen.append(op(5)))
            thread.start()
            thread.join(30)
            assert op(5) is flag and seen == [flag]
    finally:
        from picklehooks import _state
        with _state._LOCK:
            _native.set_recording(bool(_state._ANYWHERE))


def test_active_answers_whether_any_log_records():
    assert active(0) is False
    with picklehooks.record():
        assert active(0) is True
        with picklehooks.record():
            assert active(0) is True
        assert active(0) is True  # the outer log still records
    assert active(0) is False
    with pytest.raises(ZeroDivisionError):
        with picklehooks.record():
            assert active(0) is True
            1 / 0
    assert active(0) is False  # record() ended in its finally


def test_active_counts_logs_of_every_thread():
    """A log recording in another thread counts (autograd's threads deliver gradients to it)."""
    with recording_in_another_thread():
        assert active(0) is True
        seen = []
        thread = threading.Thread(target=lambda: seen.append(active(0)))
        thread.start()
        thread.join(30)
        assert seen == [True]
    assert active(0) is False


def test_active_from_torchscript_runs_the_registered_kernel():
    @torch.jit.script
    def ask(flags: int) -> bool:
        return torch.ops.picklehooks.active(flags)

    assert ask(3) is False
    with picklehooks.record():
        assert ask(3) is True
    assert ask(3) is False
    assert _ops._active_kernel(3) is False  # the Python kernel agrees


_SCRIPTED_RECORDS = """
import copy, os, torch, picklehooks
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
plain = copy.deepcopy(model)
x = torch.randn(5, 8)
# ground truth: every submodule's output, by plain forward hooks on the un-instrumented copy
want = {}
for name, m in plain.named_children():
    m.register_forward_hook(lambda mod, args, out, name=name: want.setdefault(name, out.detach().clone()))
plain(x)
picklehooks.instrument(model, capture=("output",), mode="tensor", scriptable=True, example_inputs=(x,))
scripted = torch.jit.script(model)
with torch.no_grad():
    scripted(x)  # idle: nothing to record, nothing recorded
    with picklehooks.record() as log:
        out = scripted(x)
got = {r.module: r.tensor for r in log if r.kind == "output" and r.module in want}
assert sorted(got) == sorted(want), (sorted(got), sorted(want))
for name, value in want.items():
    torch.testing.assert_close(got[name], value, rtol=0, atol=0)
dump = torch._C._dispatch_dump("picklehooks::active")
origin = [line for line in dump.splitlines() if line.startswith("CompositeExplicitAutograd")][0]
print("C" if "csrc/kernels.c" in origin else "Python", len(log))
"""


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_scripted_model_records_with_either_kernel(native, monkeypatch):
    """In a fresh process (the kernel is chosen at import): PICKLEHOOKS_NATIVE=0 keeps the Python kernel."""
    monkeypatch.setenv("PICKLEHOOKS_NATIVE", native)  # run_fresh's child inherits the environment
    kernel, count = run_fresh(_SCRIPTED_RECORDS).split()
    assert int(count) >= 3
    built = _native._speedups is not None
    assert kernel == ("C" if native == "1" and built else "Python")
