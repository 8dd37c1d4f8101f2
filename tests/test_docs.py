"""The docs site builds without a warning, and what it and the README show comes from the code."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PUBLIC = ("picklehooks", "picklehooks.diagnostics", "picklehooks.audit")


def _hooks():
    spec = importlib.util.spec_from_file_location("_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(text: str, heading: str) -> str:
    """The body of the README's ``## heading`` section."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # From another directory: every path in mkdocs.yml must be relative to the file itself.
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_site_builds_strictly(site):
    """mkdocs build --strict passes: a broken link, anchor, nav entry or API reference fails it."""
    assert (site / "index.html").is_file() and (site / "api" / "index.html").is_file()


def test_api_reference_lists_every_public_name(site):
    """Each name in the three public packages' __all__ has its entry on the API page."""
    hooks, page = _hooks(), (site / "api" / "index.html").read_text(encoding="utf-8")
    missing = [f"{package}.{name}" for package in PUBLIC for name in importlib.import_module(package).__all__
               if f'id="{hooks._defined_at(package, name)}"' not in page]
    assert not missing, missing


def test_benchmark_page_shows_every_saved_run(site):
    """Every file in bench/results/ is on the benchmarks page, with the command that produced it."""
    page = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    results = sorted((ROOT / "bench" / "results").glob("*.md"))
    assert results
    for path in results:
        command = re.match(r"<!--\s*\$ (.+?)\s*-->", path.read_text(encoding="utf-8")).group(1)
        assert f"<code>{command}</code>" in page, path.name
        assert f"<!-- bench: {path.stem} -->" in (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")


def test_readme_is_short_and_keeps_the_ci_command():
    """At most 250 lines; .ci/run runs the line after '# Run the whole test suite'."""
    lines = README.splitlines()
    assert len(lines) <= 250, len(lines)
    at = lines.index("# Run the whole test suite")
    assert "python -m pytest" in lines[at + 1] and "'.[dev]'" in lines[at + 1]


def test_readme_quickstart_prints_what_the_readme_shows(tmp_path):
    """The quickstart's code, run as it is, prints the output pasted below it."""
    quickstart = _section(README, "Quickstart")
    code = re.search(r"```python\n(.*?)```", quickstart, flags=re.S).group(1)
    shown = re.search(r"prints\n\n```text\n(.*?)```", quickstart, flags=re.S).group(1)
    (tmp_path / "quickstart.py").write_text(code)  # a file: portable() reads the hook's source
    proc = subprocess.run([sys.executable, "quickstart.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown
    assert (tmp_path / "model.pt").is_file()


def test_readme_benchmark_figures_come_from_bench_output():
    """Every figure the README's benchmark summary quotes is in a saved bench run or on the benchmarks page."""
    sources = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "bench" / "results").glob("*.md"))
    sources += (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    figures = re.findall(r"\d+\.\d+", _section(README, "Benchmarks"))
    assert figures
    assert [f for f in figures if f not in sources] == []
