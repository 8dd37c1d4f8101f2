"""What installing picklehooks declares, and that the demo runs quietly."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _names(requirements) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_numpy_is_declared():
    """torch warns "Failed to initialize NumPy" at import without numpy and doesn't declare it; we do."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "numpy" in _names(declared)
    installed = importlib.metadata.requires("picklehooks") or []
    assert "numpy" in _names(r for r in installed if "extra ==" not in r)


def test_all_extra_holds_every_integration():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    everything = _names(extras["all"])
    for name, requirements in extras.items():
        if name not in ("all", "dev", "docs"):
            assert _names(requirements) <= everything, (name, _names(requirements) - everything)
    assert _names(extras["docs"]) <= _names(extras["dev"]), "the test suite builds the docs: dev needs them"


def test_demo_prints_no_warning():
    out = subprocess.run([sys.executable, "-m", "picklehooks", "demo"], capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr and "warning" not in out.stdout.lower(), out.stderr
