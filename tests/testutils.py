"""Helpers shared by the tests: running code in a fresh interpreter, and a model in another backend."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def run_fresh(code: str, *args: str, cwd: str | os.PathLike | None = None, timeout: float = 240) -> str:
    """Run ``code`` in a fresh interpreter (``python -c``); return its stdout, fail with its stderr.

    The child does not inherit the tests' modules: nothing the parent
    imported or decoded is there unless the child loads it itself.
    """
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


#: Prelude for child code that must run as if picklehooks were not installed.
WITHOUT_PICKLEHOOKS = """
import sys
class _RefusePicklehooks:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'picklehooks':
            raise ImportError('picklehooks is not installed on this host: ' + name)
sys.meta_path.insert(0, _RefusePicklehooks())
"""


def run_without_picklehooks(code: str, *args: str, **kwargs) -> str:
    """Like :func:`run_fresh`, with every import of picklehooks refused; checks it stayed out."""
    epilogue = "\nassert not [m for m in sys.modules if m.split('.')[0] == 'picklehooks'], 'picklehooks leaked in'\n"
    return run_fresh(WITHOUT_PICKLEHOOKS + textwrap.dedent(code) + epilogue, *args, **kwargs)


def transformed(model, backend: str, inputs: tuple):
    """``model`` as ``backend`` runs it in this process: "eager", "script", "fx", "compile" (fullgraph) or "export"."""
    if backend == "eager":
        return model
    if backend == "script":
        return torch.jit.script(model)
    if backend == "fx":
        return torch.fx.symbolic_trace(model)
    if backend == "compile":
        torch._dynamo.reset()
        return torch.compile(model, fullgraph=True)
    if backend == "export":
        return torch.export.export(model, tuple(inputs)).module()
    raise ValueError(f"unknown backend {backend!r}")


@contextlib.contextmanager
def recording_in_another_thread():
    """A ``record()`` open in another thread for the duration of the block; yields its log."""
    import picklehooks

    started, done, logs = threading.Event(), threading.Event(), []

    def recorder():
        with picklehooks.record() as log:
            logs.append(log)
            started.set()
            done.wait(30)

    thread = threading.Thread(target=recorder)
    thread.start()
    try:
        assert started.wait(30), "the other thread's record() didn't start"
        yield logs[0]
    finally:
        done.set()
        thread.join(30)


def use_lanes(monkeypatch, add_row, forward_lane, grad_recorder) -> None:
    """Put these lanes where their callers read them: the row lane in the row-writing path, the
    forward lane in ``_hookrt.forward``, the gradient recorder in the eager taps."""
    import picklehooks.capture.rows
    from picklehooks import _hookrt, _taps

    monkeypatch.setattr(picklehooks.capture.rows, "_add_row", add_row)
    monkeypatch.setattr(_hookrt, "_forward_lane", forward_lane)
    monkeypatch.setattr(_taps, "_GradRecorder", grad_recorder)


def use_python_lanes(monkeypatch) -> None:
    """Switch off the C lanes (csrc/rows.c's row lane, csrc/hooks.c's hook lane):
    records go through ``_hookrt`` and ``Log._add_tensor`` in Python, still with the native statistics."""
    from picklehooks import _taps

    use_lanes(monkeypatch, None, None, _taps._PyGradRecorder)


def use_pytorch_stats(monkeypatch) -> None:
    """Make logs take the PyTorch fallback (copies reduced in batches), as on a machine without
    the native extensions or with ``PICKLEHOOKS_NATIVE=0``: no native pass, no C lanes."""
    import picklehooks.capture.rows

    monkeypatch.setattr(picklehooks.capture.rows, "native_stats", lambda x: None)
    use_python_lanes(monkeypatch)


def plain_stats(t: torch.Tensor) -> dict:
    """Every documented statistic of ``t`` by its definition: plain PyTorch in float64, population std
    (for values whose float64 sums can't overflow; tests/capture/test_stats_faithful.py scales the others)."""
    v = t.detach().to(torch.float64)
    return {
        "mean": v.mean().item(),
        "std": v.std(correction=0).item(),
        "min": v.min().item(),
        "max": v.max().item(),
        "absmax": v.abs().max().item(),
        "norm": torch.linalg.vector_norm(v).item(),
        "n_nan": int(torch.isnan(v).sum()),
        "n_inf": int(torch.isinf(v).sum()),
        "zero_frac": (v == 0).sum().item() / v.numel(),
    }
