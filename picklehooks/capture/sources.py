"""Where a record came from: the line of code that called its module, found once per call.

A record's ``source`` (``Record.source``, the ``source`` column of tables, sinks and
``records.json``) reads

    ``transformers/models/gpt2/modeling_gpt2.py:412 in GPT2MLP.forward (NewGELUActivation, transformers/activations.py:56)``

the line that called the module (in the parent's ``forward``; for the root, the line that
called the model), the function it is in, then the module's class and the line that defines
it. Each call of a module has its own source (one ``nn.Identity`` used at three places, a
block called in a loop from one line).

**How.** While a log records in eager mode, the first hook that runs for a module call (its
pre-hook, else its forward hook) asks the log (:meth:`Sources._call_begins`), which counts the
module's calls as the records' ``call`` counts them and, for a ``(module, call)`` it has no
source for yet, walks up the Python stack to the first frame that is neither ``nn.Module``'s
call machinery, nor a module's own ``__call__`` (Hugging Face's ``GradientCheckpointingLayer``),
nor picklehooks. The text of each (code, line) and of each class is made once per process. So
the steady state (a training loop, whose steps count calls from 0) costs one dictionary look-up
per module call; a log that never starts a step counts calls on, and finds each new one's
source (a few µs).

**Files** are named by their module (``transformers/models/gpt2/modeling_gpt2.py``, relative to
the directory it is imported from), so a model loaded with ``torch.load`` in another process
or from a ``torch.package`` archive (whose modules are ``<torch_package_0>.…``) names the same
files as the model it was saved from; a script run as ``__main__`` is named by its file name.

**torch.compile.** Dynamo runs the hooks as Python while it traces: each value a graph records
gets a site number (:func:`picklehooks._ops.compiled_site`, a constant Dynamo calls while
tracing), which remembers the stack Dynamo was tracing (its translators' code, line and
globals). When the graph's op records the value, the log turns that stack into the record's
source (:func:`traced_source`, by the rule the live walk follows), once per ``(module, call)``.

**jit.trace, FX, torch.export.** Their hooks run (or Dynamo traces them) while the graph is
made, and put a ``picklehooks::call_site(module, site, cls)`` op into it once per module call
(:mod:`picklehooks._sites`); the op's kernel tells the log (:meth:`Sources._call_site`), which
counts the call as eager mode does. A saved program carries its sources. The call the tracer
made (the root's) has an empty site: the line that calls the program, found when it runs.

**jit.script.** A scripted program has no ``call_site`` ops (TorchScript compiles a module's
hooks once, not per call): a record its ops make without one asks the log
(:meth:`Sources._script_site`), which reads the program's graphs once
(:func:`picklehooks.capture.script_sites.scripted_source`): each module call there keeps its source range.

The texts themselves are made by :mod:`picklehooks._sites`, part of the hook runtime (it travels
into torch.package archives).

Limits: FX's calls of leaf modules (``nn.Linear``: called from the ``forward`` FX generates,
with no line kept), and a scripted program's calls inside a loop or branch of its graph, have no
source (``None``), never another form's line. A module called recursively (from inside its own call) may get its calls' sources
swapped; under ``torch.compile``, where Inductor can reorder a graph's record ops (see the
limitations page), so may a module called twice.
"""

from __future__ import annotations

from .._sites import caller_source, describe_class, run_site, traced_text
from .script_sites import scripted_source

__all__ = ["caller_source", "describe_class", "graph_source", "traced_source"]


def traced_source(frames: tuple) -> str | None:
    """The source of a value a ``torch.compile`` graph records, from the stack Dynamo was tracing
    (:data:`picklehooks._ops.SITE_FRAMES`), by :func:`picklehooks._sites.traced_text`. Once per
    stack: the text is kept by the tuple's identity (the runtime keeps every tuple)."""
    key = id(frames)
    if key not in _TRACED:
        _TRACED[key] = traced_text(frames)
    return _TRACED[key]


_TRACED: dict[int, str | None] = {}
_JOINED: dict[tuple, str] = {}


def graph_source(site: str, cls: str) -> str | None:
    """The source text of a call whose site a traced graph carries (``picklehooks::call_site``):
    ``site`` and ``cls`` joined, or, for an empty ``site`` (the call the tracer made: the
    root's), the line that calls the program now."""
    if not site:
        site = run_site()
        return None if site is None else f"{site} ({cls})"
    text = _JOINED.get((site, cls))
    if text is None:
        text = _JOINED[(site, cls)] = f"{site} ({cls})"
    return text


class Sources:
    """A log's sources: ``(module, call) -> source``, found as calls begin (see the module docstring).

    Mixed into the log's row-writing side; the hook runtime calls :meth:`_call_begins` by name
    (an earlier version's log has none, and its records no source)."""

    def __init__(self) -> None:
        self._sources: dict[tuple[str, int], str | None] = {}
        self._invocations: dict[str, int] = {}
        self._begun: set[str] = set()  # modules whose pre-hook counted the call their forward hook ends

    def _restart_sources(self) -> None:
        """Count calls from 0 again (with the records' ``call``, at a step's start); sources stay."""
        self._invocations.clear()
        self._begun.clear()

    def _call_begins(self, module, name: str, pre: bool) -> None:
        """A call of ``module`` (named ``name``) is running its hooks: the pre-hook's (``pre``) or, for a
        module without one, its forward hook's. Counts the call; finds its source once."""
        if not pre and name in self._begun:
            self._begun.discard(name)  # its pre-hook counted this call
            return
        if pre:
            self._begun.add(name)
        key = self._count_call(name)
        if key not in self._sources:
            self._sources[key] = caller_source(type(module), 2)

    def _count_call(self, name: str) -> tuple[str, int]:
        """``(name, call)`` of the call of module ``name`` that begins: counted here."""
        invocations = self._invocations
        call = invocations.get(name, 0)
        invocations[name] = call + 1
        return name, call

    def _call_site(self, module: str, site: str, cls: str) -> None:
        """A traced program (``jit.trace``, FX, ``torch.export``) calls ``module``: its graph's
        ``call_site`` op says from where (called by the op's kernel, by name). Counts the call."""
        key = self._count_call(module)
        if key not in self._sources:
            self._sources[key] = graph_source(site, cls)

    def _script_site(self, module: str, kind: str, path: str) -> None:
        """A program's op recorded (or counted) a value of ``module`` without a site: a scripted
        program's, which has no ``call_site`` ops (or one traced before they existed). Its source
        comes from the program's graphs (:func:`picklehooks.capture.script_sites.scripted_source`), once per
        ``(module, call)`` (called by the op's kernel, by name)."""
        key = (module, self._last_call(module, kind, path))
        if key not in self._sources:
            self._sources[key] = scripted_source(module, key[1])

    def _last_call(self, module: str, kind: str, path: str) -> int:
        """The call of ``module`` that the value just recorded (or counted) belongs to."""
        rows = self._rows
        row = rows[-1] if rows else None
        if row is not None and row[0] == module and row[1] == kind and row[2] == path:
            return row[3]
        return self._calls.get((module, kind, path), 1) - 1  # counted without a row, or read meanwhile

    def _graph_call_site(self, module: str, kind: str, path: str, frames: tuple) -> None:
        """A ``torch.compile`` graph's op just recorded (or counted) a value of ``module``: give the
        record's ``(module, call)`` the source tracing saw (called by the op's kernel, by name)."""
        key = (module, self._last_call(module, kind, path))
        if key not in self._sources:
            self._sources[key] = traced_source(frames)
