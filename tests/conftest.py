"""Session set-up shared by every test file."""

from __future__ import annotations

import os
import shutil
import tempfile

_CACHE_DIR: str | None = None


def pytest_configure(config):
    """A fresh Inductor cache for every test session (and xdist worker).

    A warm cache once hid a real bug: a compiled graph from an older run of the
    code was reused instead of compiling what the code now produces. Child
    processes the tests start inherit the variable, so they share this fresh cache.
    """
    global _CACHE_DIR
    _CACHE_DIR = tempfile.mkdtemp(prefix="picklehooks-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE_DIR


def pytest_unconfigure(config):
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture(params=["native", "fallback"])
def stats_path(request, monkeypatch):
    """Both ways a log computes statistics: the native one-pass kernel in the hook, and
    the PyTorch fallback (copies reduced in batches) that other devices and dtypes, a
    machine without the extension, and ``PICKLEHOOKS_NATIVE=0`` use."""
    from picklehooks import _native

    from tests.testutils import use_pytorch_stats

    if request.param == "native":
        if not _native.AVAILABLE:
            pytest.skip("the native statistics extension isn't built here")
    else:
        use_pytorch_stats(monkeypatch)
    return request.param
