"""``python -m picklehooks inspect FILE``: print an :class:`AuditReport` and return its exit status.

The output is bounded (:attr:`._limits.Limits.output_chars`): past it,
printing stops with a "could not print" line and the incomplete-read bit.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .._shim import HUB_NAME
from ..serialize.hookdoc import fingerprint
from ._hooks import HookEntry
from ._limits import AuditError, printable
from ._report import EXIT_INCOMPLETE, EXIT_UNREADABLE, AuditReport, audit_file

_printable = printable  # picklehooks.diagnostics.report uses these two


def _write(line: str, stream: Any = None) -> None:
    stream = stream or sys.stdout
    encoding = getattr(stream, "encoding", None) or "utf-8"
    # An ASCII terminal still gets every line, with escapes for what it can't show.
    print(line.encode(encoding, "backslashreplace").decode(encoding), file=stream)


class _Output:
    """Writes lines to stdout until ``budget`` characters are spent."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.cut = False

    def __call__(self, line: str) -> None:
        if self.cut:
            return
        self.left -= len(line) + 1
        if self.left < 0:
            self.cut = True
            return
        _write(line)


def _abbrev(name: str) -> str:
    name = printable(name, one_line=True) if len(name) <= 200 else printable(name[:24] + name[-12:], one_line=True)
    return name if len(name) <= 40 else f"{name[:24]}...{name[-12:]}"


def _header(entry: HookEntry) -> str:
    if entry.kind == "function":
        where = "function outside any module hook dict"
    else:
        module = "(root)" if entry.module == "" else printable(entry.module, one_line=True)
        where = f"{printable(entry.kind, one_line=True)} hook on {module}"
    resource = f" [{printable(entry.resource, one_line=True)}]" if entry.resource else ""
    if entry.foreign:
        name = printable(entry.name[:200], one_line=True)
        return f"{where}{resource}: foreign hook {name} (not decodable; loading will import it)"
    return (f"{where}{resource}: {HUB_NAME}.{_abbrev(entry.name)} ({len(entry.name)} chars, "
            f"fingerprint {fingerprint(entry.name)})")


def _global_line(path: str, status: str, called: bool, resources: list[str]) -> str:
    shown = f"{HUB_NAME}.{_abbrev(path[len(HUB_NAME) + 1 :])}" if status == "hook" else printable(path[:300], one_line=True)
    where = f" [{printable(', '.join(resources)[:200], one_line=True)}]" if any(resources) else ""
    return f"  {status:<6}  {shown}{' (called)' if called else ''}{where}"


def _print(report: AuditReport, shown: str) -> None:
    out = _Output(report.limits.output_chars)
    ours = [e for e in report.entries if not e.foreign]
    foreign = [e for e in report.entries if e.foreign]
    bad = [e for e in ours if e.error is not None]
    if not ours:
        out(f"no picklehooks hooks found in {shown}")
    else:
        counts = f"{len(ours)} picklehooks hook{'s' * (len(ours) != 1)}"
        if bad:
            counts += f" ({len(bad)} undecodable)"
        if foreign:
            counts += f", {len(foreign)} foreign"
        out(f"{shown}: {counts}")
    for entry in report.entries:
        out("")
        out(_header(entry))
        if entry.error is not None:
            out(f"    error: {printable(entry.error, one_line=True)}")
        elif entry.source is not None:
            imports = report.imports.get(entry.name, [])
            listed = imports if isinstance(imports, str) else ", ".join(imports) or "(none)"
            out(f"    imports: {printable(listed, one_line=True)}")
            for line in printable(entry.source).rstrip("\n").split("\n"):
                out(f"    {line}".rstrip())
    unsafe = report.unsafe
    out("")
    out(
        f"globals: {len(report.globals)} that loading imports or calls, {len(unsafe)} UNSAFE "
        "(outside torch.load(weights_only=True)'s default allowlist and not a picklehooks hook)"
    )
    for use in sorted(report.globals, key=lambda u: (u.status != "UNSAFE", u.status, u.path)):
        out(_global_line(use.path, use.status, use.called, use.resources))
    if report.irregular:
        out("")
        out(f"frames: {len(report.irregular)} UNSAFE (a file reader and pickle.loads read what follows differently; "
            "both readings are audited above)")
        for message in report.irregular:
            out(f"  UNSAFE  {printable(message, one_line=True)}")
    if report.bundled:
        out("")
        out(f"bundled modules: {len(report.bundled)} (importing the archive runs them)")
        for b in report.bundled:
            if b.status == "same":
                note = "ok      {} (identical to this picklehooks version's)"
            elif b.status == "differs":
                note = "UNSAFE  {} differs from the one this picklehooks version writes"
            else:
                note = "UNSAFE  {} (code that runs on import)"
            out("  " + note.format(printable(b.module[:300], one_line=True)))
    for note in report.notes:
        out("")
        out(printable(note, one_line=True))
    for problem in report.problems:
        out("")
        out(printable(problem, one_line=True))
    if out.cut:
        report.problems.append("could not print everything")
        _write(
            f"picklehooks inspect: could not print everything: the output exceeds {report.limits.output_chars} "
            "characters, the bound for this file; treat as unsafe",
            sys.stderr,
        )


def main(path: str) -> int:
    """Audit ``path`` and print the report; return the exit status.

    The status is a sum of bits: 0 when the file was read completely and
    names only allowlisted globals and decodable picklehooks hooks;
    1 when the file can't be audited at all (one error line on stderr,
    nothing on stdout); 2 when a hook name does not decode; 4 when the file
    names an unsafe global, bundles code, or has a FRAME that does not end
    on an opcode boundary; 8 when some part could not be read completely
    ("could not read ...; treat as unsafe").
    """
    shown = printable(os.fspath(path), one_line=True)
    try:
        report = audit_file(path)
        _print(report, shown)
    except AuditError as exc:
        _write(f"picklehooks inspect: error: {shown}: {printable(str(exc), one_line=True)}", sys.stderr)
        return EXIT_UNREADABLE
    except (RecursionError, MemoryError) as exc:  # a bound we missed: still one line, never a traceback
        _write(f"picklehooks inspect: error: {shown}: could not read the file: {type(exc).__name__}; treat as unsafe", sys.stderr)
        return EXIT_UNREADABLE
    return report.exit_code | (EXIT_INCOMPLETE if report.problems else 0)
