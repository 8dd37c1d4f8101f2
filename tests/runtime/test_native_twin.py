"""The switch between the C extension ``picklehooks._speedups`` and its Python twin (``picklehooks._native``).

The twin has every name the extension exports, with the same signature; a build
missing one of them counts as no build; and the native test files pass with the
twin as they do with the extension: ``PICKLEHOOKS_NATIVE=0`` is read once, at
import, so they run again in a fresh pytest process with it set.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from picklehooks import _native
from tests.testutils import run_fresh

HERE = Path(__file__).resolve().parent
ROOT = next(p for p in HERE.parents if (p / "setup.py").exists())
#: The test files whose subject is the native code (beside this one); each holds whichever implementation is on.
NATIVE_TESTS = ("test_native_stats.py", "test_record_lane.py", "test_hook_lane.py", "test_record_builder.py",
                "test_op_kernels.py", "test_tree_walk.py")

needs_extension = pytest.mark.skipif(_native._speedups is None, reason="picklehooks._speedups is not built here")


def _called(namespace) -> set[str]:
    """The names callers call: the functions, and GradRecorder (Stats is what stats() returns)."""
    return {name for name, value in vars(namespace).items()
            if not name.startswith("_") and callable(value) and name != "Stats"}


@needs_extension
def test_every_function_of_the_extension_has_a_twin_of_the_same_signature():
    names = _called(_native._speedups)
    assert names == _called(_native._twin)
    for name in sorted(names):
        c, twin = getattr(_native._speedups, name), getattr(_native._twin, name)
        assert inspect.signature(c) == inspect.signature(twin), name
    # And the rest of what the twin has, the extension has too (what _native reads: DTYPE_CODES, ACTIVE, Stats).
    assert set(_native._NAMES) <= set(vars(_native._speedups))


def test_a_build_without_one_of_the_twins_names_counts_as_none():
    """A stale build (an older version's, say) is not called with arguments it may not take."""
    out = run_fresh("""
        import sys, types
        stale = types.ModuleType("picklehooks._speedups")
        stale.stats = lambda *args: None
        sys.modules["picklehooks._speedups"] = stale
        from picklehooks import _native
        print(_native._speedups, _native.AVAILABLE, _native._impl is _native._twin)
    """)
    assert out.split() == ["None", "False", "True"]


@pytest.mark.skipif(not _native.AVAILABLE, reason="this run uses the twin already (PICKLEHOOKS_NATIVE=0, or no build)")
@pytest.mark.parametrize("name", NATIVE_TESTS)
def test_the_native_tests_pass_with_the_twin(name):
    """The file again, in a fresh pytest process with PICKLEHOOKS_NATIVE=0: a log records the same there."""
    env = {**os.environ, "PICKLEHOOKS_NATIVE": "0"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / name)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
