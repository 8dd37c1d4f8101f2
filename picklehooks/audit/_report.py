"""The verdict: every global a load would import or call, which are unsafe, and each hook's text.

A global is *safe* when it is in ``torch.load(weights_only=True)``'s default
allowlist (``torch._weights_only_unpickler._get_allowed_globals()``, read
from the installed torch at run time) or is a picklehooks hook
(``picklehooks._hub.<name>``, whose text is shown instead). Everything else
is *unsafe*: loading the file imports it, and calls it where the pickle
says so. ``os.system``, ``builtins.exec`` and a model's own classes are all
unsafe in this sense: this is ``weights_only``'s line, not a judgment of
intent.

Hook names are decoded (decompressed) and their text parsed with :mod:`ast`
to list its imports; nothing is imported, compiled or run.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass, field

from .._shim import DecodeError, MAX_SOURCE_BYTES, PicklehooksError
from ..serialize import hookdoc
from ..serialize.codec import decode
from ._containers import Bundled, Contents, Unreadable, read
from ._hooks import HookEntry, collect
from ._limits import MAX_MEMBER_BYTES, AuditError, Limits, show
from ._machine import Parsed
from .policy import verdict

# Exit status bits of ``python -m picklehooks inspect`` (see the package docstring).
EXIT_UNREADABLE = 1
EXIT_UNDECODABLE = 2
EXIT_UNSAFE = 4
EXIT_INCOMPLETE = 8


@dataclass
class GlobalUse:
    """One distinct global the file names: ``status`` is ``"ok"``, ``"hook"`` or ``"UNSAFE"``."""

    path: str
    status: str
    called: bool = False
    via: set[str] = field(default_factory=set)
    resources: list[str] = field(default_factory=list)


@dataclass
class AuditReport:
    """Everything :func:`audit_file` found in one file."""

    path: str
    entries: list[HookEntry]
    globals: list[GlobalUse]
    bundled: list[Bundled]
    problems: list[str]  # "could not read ...; treat as unsafe", one per part
    imports: dict[str, list[str] | str]  # hook name -> its imports, or why they are unknown
    limits: Limits
    # FRAMEs that don't end on an opcode boundary, one message each: file readers and pickle.loads
    # read such a file differently (both readings are audited), which no pickler writes: UNSAFE.
    irregular: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what else a hooks document says (its instrumentation spec)

    @property
    def unsafe(self) -> list[GlobalUse]:
        return [g for g in self.globals if g.status == "UNSAFE"]

    @property
    def unsafe_bundled(self) -> list[Bundled]:
        return [b for b in self.bundled if b.status != "same"]

    @property
    def exit_code(self) -> int:
        code = 0
        if any(e.error is not None for e in self.entries):
            code |= EXIT_UNDECODABLE
        if self.unsafe or self.unsafe_bundled or self.irregular:
            code |= EXIT_UNSAFE
        if self.problems:
            code |= EXIT_INCOMPLETE
        return code


def _globals(resources: list[tuple[str, list[Parsed]]]) -> list[GlobalUse]:
    found: dict[str, GlobalUse] = {}
    for resource, parsed in resources:
        for one in parsed:
            called = {g.path for g in one.called}
            for g in one.globals:
                use = found.get(g.path)
                if use is None:
                    use = found[g.path] = GlobalUse(g.path, "")
                use.via.add(g.via)
                use.called |= g.path in called
                if not use.resources or use.resources[-1] != resource:
                    if resource not in use.resources:
                        use.resources.append(resource)
    for use in found.values():
        use.status = verdict(use.path, use.called)
    return list(found.values())


def imports_of(source: str) -> list[str]:
    """The modules a hook's text imports (anywhere in it), in order; raises SyntaxError/ValueError."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return list(dict.fromkeys(names))


class _Decoder:
    """Decodes each hub name once, within the file's bound on decoded text."""

    def __init__(self, limits: Limits, problems: list[str]) -> None:
        self.limits, self.problems = limits, problems
        self.cache: dict[str, tuple[str | None, str | None]] = {}
        self.used = 0
        self.bound_hit = False

    def __call__(self, name: str) -> tuple[str | None, str | None]:
        if name not in self.cache:
            self.cache[name] = self._decode(name)
        return self.cache[name]

    def _decode(self, name: str) -> tuple[str | None, str | None]:
        left = self.limits.decoded_bytes - self.used
        limit = min(MAX_SOURCE_BYTES, left)
        try:
            if limit <= 0:
                raise DecodeError("not decoded: the bound on decoded hook text is used up")
            source = decode(name, max_source_bytes=limit)
        except DecodeError as exc:
            if limit < MAX_SOURCE_BYTES and not self.bound_hit:
                self.bound_hit = True
                self.problems.append(
                    f"could not read every hook: their decoded text exceeds {self.limits.decoded_bytes} bytes, "
                    f"the bound for a {self.limits.file_size}-byte file; treat as unsafe"
                )
            return None, str(exc)
        self.used += len(source)
        return source, None


def _summary(partial: Parsed | None) -> str:
    """What a load would have imported before failing, for the one-line error."""
    if partial is None:
        return ""
    unsafe = [u.path for u in _globals([("", [partial])]) if u.status == "UNSAFE"]
    if not unsafe:
        return ""
    names = ", ".join(show(p, 60) for p in unsafe[:5]) + (", ..." if len(unsafe) > 5 else "")
    return f"; before that it names {len(unsafe)} unsafe global(s) ({names}); treat as unsafe"


def audit_file(path: str | os.PathLike[str]) -> AuditReport:
    """Read ``path`` without loading it and report what loading it would import, call and decode.

    >>> report = audit_file("model.pt")                       # doctest: +SKIP
    >>> [g.path for g in report.unsafe], report.exit_code     # doctest: +SKIP

    Raises :class:`AuditError` if the file can't be read at all, or a bound
    on memory or time is hit.
    """
    path = os.fspath(path)
    if os.path.isdir(path) or path.endswith((".json", ".safetensors")):
        return _document_report(path)
    try:
        contents, limits = read(path)
    except Unreadable as exc:
        raise AuditError(f"{exc}{_summary(exc.partial)}") from None
    except (RecursionError, MemoryError) as exc:  # a bound we missed; still one line, never a traceback
        raise AuditError(f"could not read the file: {type(exc).__name__}; treat as unsafe") from None
    return _report(path, contents, limits)


def _report(path: str, contents: Contents, limits: Limits) -> AuditReport:
    problems = list(contents.problems)
    decoder = _Decoder(limits, problems)
    entries: list[HookEntry] = []
    for resource in contents.resources:
        entries += collect(resource.parsed, resource.name, decoder)
    found = _globals([(r.name, r.parsed) for r in contents.resources])
    return AuditReport(path, entries, found, contents.bundled, problems, _imports(entries), limits,
                       list(contents.irregular))


def _imports(entries: list[HookEntry]) -> dict[str, list[str] | str]:
    imports: dict[str, list[str] | str] = {}
    for entry in entries:
        if entry.source is not None and entry.name not in imports:
            try:
                imports[entry.name] = imports_of(entry.source)
            except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
                imports[entry.name] = f"unknown: the text does not parse ({type(exc).__name__}: {str(exc)[:200]})"
    return imports


def _document_report(path: str) -> AuditReport:
    """The hooks ``save_hooks`` wrote as text: a model directory's config.json and safetensors metadata.

    Such files hold no pickle: nothing in them is imported or called by a load, only the
    hooks ``load_hooks(trust=...)`` would attach; their text is decoded here, never run.
    """
    files = []
    try:
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "config.json")):
                files.append(os.path.join(path, "config.json"))
            files += sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise AuditError("a directory without config.json or .safetensors files; give a file to inspect")
        else:
            files.append(path)
        for file in files:
            if file.endswith(".json") and os.path.getsize(file) > MAX_MEMBER_BYTES:
                raise AuditError(f"{os.path.basename(file)} is over {MAX_MEMBER_BYTES} bytes; treat as unsafe")
        docs = [(os.path.basename(file), hookdoc.read(file)) for file in files]
    except OSError as exc:
        raise AuditError(f"can't read it: {exc.strerror or exc}") from None
    except PicklehooksError as exc:
        raise AuditError(str(exc)) from None
    problems: list[str] = []
    limits = Limits(sum(os.path.getsize(f) for f in files))
    decoder = _Decoder(limits, problems)
    entries, notes = [], []
    for resource, doc in docs:
        if doc is None:
            continue
        for hook in doc["hooks"]:
            entries.append(HookEntry(hook["module"], hook["kind"], hook["name"], *decoder(hook["name"]), resource))
        if doc["spec"] is not None:
            notes.append(f"instrumentation spec [{resource}] (settings, not code; load_hooks applies it): "
                         + json.dumps(doc["spec"], sort_keys=True))
    return AuditReport(path, entries, [], [], problems, _imports(entries), limits, [], notes)


def find_hooks(path: str | os.PathLike[str]) -> list[HookEntry]:
    """Return the hooks in the checkpoint, package or pickle at ``path``, without loading it.

    >>> [e.name for e in find_hooks("model.pt") if not e.foreign]   # doctest: +SKIP

    Raises :class:`AuditError` if the file, or any part of it, can't be read
    completely, is read differently by file readers and ``pickle.loads``
    (a FRAME that does not end on an opcode boundary), or is not a pickle,
    ``torch.save`` checkpoint, ``torch.package`` archive or NumPy file.
    """
    report = audit_file(path)
    if report.problems:
        raise AuditError(report.problems[0])
    if report.irregular:
        raise AuditError(f"{report.irregular[0]}; treat as unsafe")
    return report.entries
