"""Griffe extension: read picklehooks' reStructuredText-flavoured docstrings as Markdown.

The docstrings are written for ``help()`` and Sphinx-style readers: ``>>>``
examples, ``text::`` literal blocks and roles such as ``:func:`record```. In
Markdown a ``>>>`` line is a nested quote and ``[0]["x"]`` looks like a link,
so this turns doctest lines and literal blocks into fenced code and roles
into code spans. Nothing else changes.

Limits: only these three constructs; other reST (tables, directives) would
show as text. None is used in the package today.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|exc|obj):`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_ESCAPED_SPACE = re.compile(r"`\\ ")


def _role(match: re.Match) -> str:
    text = match.group(1).strip()
    return f"`{text.rsplit('.', 1)[-1] if match.group(0).count('~') else text}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def to_markdown(text: str) -> str:
    """``text`` with doctest runs and ``::`` literal blocks fenced, and roles as code spans."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith(">>>"):
            pad = line[:_indent(line)]
            block = []
            while i < len(lines) and lines[i].strip() and lines[i].startswith(pad):
                block.append(lines[i][len(pad):])
                i += 1
            out += [f"{pad}```python", *(pad + b for b in block), f"{pad}```"]
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            base = _indent(line)
            head = line.rstrip()[:-2].rstrip()
            out.append(head + ":" if head.strip() else "")
            i += 1
            block = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            body = [b for b in block if b.strip()]
            cut = min((_indent(b) for b in body), default=0)
            pad = line[:base]
            out += ["", f"{pad}```", *((pad + b[cut:]) if b.strip() else "" for b in block[_leading_blank(block):]),
                    f"{pad}```", ""]
            continue
        out.append(_ESCAPED_SPACE.sub("`", _ROLE.sub(_role, line)))
        i += 1
    return "\n".join(out)


def _leading_blank(block: list[str]) -> int:
    n = 0
    while n < len(block) and not block[n].strip():
        n += 1
    return n


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring once, as the object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
