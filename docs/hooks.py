"""MkDocs hooks: fill the generated parts of the site at build time.

* ``<!-- bench: NAME -->`` becomes the saved output of a benchmark run,
  ``bench/results/NAME.md``: the Markdown tables the bench scripts print,
  with the command that produced them (the file's first line, an HTML
  comment). Tables are never copied into the pages by hand.
* ``<!-- api: PACKAGE -->`` becomes one mkdocstrings directive per name in
  ``PACKAGE.__all__``, read from the installed code, so the reference
  follows the code when modules move. A public name that shares its name
  with a submodule (``picklehooks.portable`` the function and
  ``portable.py``) is hidden from static analysis by the submodule; such
  names are documented at the path where they are defined.
* ``contract.md`` (the wire contract, written separately) gets a placeholder
  page while it doesn't exist, so the nav can name it.

Limits: ``api`` imports the package (and so torch) during the build.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

_BENCH = re.compile(r"^<!-- bench: ([\w-]+) -->$", re.M)
_API = re.compile(r"^<!-- api: ([\w.]+) -->$", re.M)
_COMMAND = re.compile(r"\A<!--\s*\$ (.+?)\s*-->\n")
_HEADING = re.compile(r"^(#{1,6}) ", re.M)


def bench_section(name: str, level: int = 3) -> str:
    """``bench/results/NAME.md`` as page Markdown: its title a plain line, its headings at ``level`` and below."""
    path = RESULTS / f"{name}.md"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: save a bench run there (see docs/benchmarks.md)")
    text = path.read_text(encoding="utf-8")
    match = _COMMAND.match(text)
    if match is None:
        raise ValueError(f"{path} must start with the command that produced it: <!-- $ python bench/... -->")
    body = text[match.end():].strip()
    title = _HEADING.match(body)
    if title is not None:  # the bench's own title (some name the host): a plain line under the page's heading
        line, _, rest = body.partition("\n")
        body = f"*{line[title.end():].strip()}*\n{rest}"
    levels = [len(m.group(1)) for m in _HEADING.finditer(body)]
    shift = level - min(levels) if levels else 0
    body = _HEADING.sub(lambda m: "#" * min(6, len(m.group(1)) + shift) + " ", body)
    return f"Produced by `{match.group(1)}` (saved in `bench/results/{name}.md`):\n\n{body}\n"


def _defined_at(package: str, name: str) -> str:
    """The identifier mkdocstrings can load for ``package.name``."""
    module = importlib.import_module(package)
    obj = getattr(module, name)
    if inspect.ismodule(obj):
        return obj.__name__
    here = Path(module.__file__).parent
    shadowed = (here / f"{name}.py").exists() or (here / name / "__init__.py").exists()
    if shadowed and getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"{package}.{name}"


def api_section(package: str) -> str:
    """The module's docstring, then each name of its ``__all__``, in that order."""
    module = importlib.import_module(package)
    blocks = [f"::: {package}\n    options:\n      members: false\n      show_root_full_path: true\n"]
    for name in module.__all__:
        blocks.append(f"::: {_defined_at(package, name)}\n    options:\n      heading_level: 3\n"
                      "      show_root_full_path: false\n")
    return "\n".join(blocks)


def on_page_markdown(markdown, page, config, files):
    markdown = _BENCH.sub(lambda m: bench_section(m.group(1)), markdown)
    return _API.sub(lambda m: api_section(m.group(1)), markdown)
