"""Every example runs to completion (they are documentation that must not rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path):
    """The example exits 0."""
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_demo_runs():
    """python -m picklehooks demo shows the hook firing in the child process."""
    proc = subprocess.run([sys.executable, "-m", "picklehooks", "demo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    child = proc.stdout.split("loading it in a fresh process:")[1]
    assert child.count("[hook activations]") == 2 and "demo module imported: False" in child
