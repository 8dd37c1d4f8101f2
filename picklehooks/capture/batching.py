"""One host call for a compiled graph's records, in program order.

In a graph ``torch.compile`` makes, each recorded value is a ``picklehooks::record`` op (or
``record_stats``, where the graph computed the statistics), an ORDERED effect threaded by a
token. Inductor calls each as an opaque kernel: a trip from its Python wrapper through the
dispatcher into Python, about 3 µs before any statistics (``bench/bench_logging.py --only
compile``). And Inductor in torch 2.13 drops the ordering edges between effectful ops
(pytorch/pytorch#189209), so it may run them out of program order, which numbers a module's
calls wrongly.

:class:`RecordBatching`, one of Inductor's post-grad passes, replaces each run of record
and record_stats ops that follow one another on the token chain by one
``picklehooks::record_batch`` op at the run's last place, whose kernel records the values
one by one in the order the program made them: one host call per run, and call numbers
whatever order Inductor runs the graph in. Other effect ops (``record_state``, ``watch``)
end a run, so they keep their places between records.

:func:`install` adds the pass to ``torch._inductor.config.post_grad_custom_post_pass``
(after any pass already there) the first time a graph with a record op is traced
(``picklehooks._ops._ON_TRACE``): a process that compiles no instrumented model never
imports Inductor for it. The pass changes only graphs holding picklehooks record ops.

Inductor (torch 2.13) caches no graph with effect ops on disk ("Can't cache HigherOrderOperator:
with_effects"); :meth:`RecordBatching.uuid` keys a torch that does on this file and the kernel's.

Limits: only Inductor batches (other backends, ``torch.export`` and AOTInductor keep one op
per record). A run holds its values alive until its end, so runs are cut where the values
would exceed :data:`BUDGET` bytes (a value whose size is symbolic counts as the whole budget).
A graph that checks values for NaN/Inf (``on_nonfinite``) keeps one op per record: a raise
mid-graph must keep the records made before it. Backward graphs' gradient records are
``tap_grad`` ops in the dataflow, not effects: they stay one op each. Where the config
already holds a single pass and this torch takes no list, nothing is batched.
"""

from __future__ import annotations

import hashlib
import operator
import os

import torch

from .. import _ops

__all__ = ["BUDGET", "RecordBatching", "install"]

#: Bytes of recorded values one batch may hold alive past their last use in the graph.
BUDGET = 32 << 20

_RECORDS = {torch.ops.picklehooks.record.default, torch.ops.picklehooks.record_stats.default}
_TAP = torch.ops.picklehooks.tap.default
_HERE = os.path.abspath(__file__)


def _with_effects():
    return getattr(torch.ops.higher_order, "with_effects", None)


def _token_out(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node that takes the token out of an effect node's results (its only user), or None."""
    (user,) = node.users if len(node.users) == 1 else (None,)
    if user is not None and user.target is operator.getitem and user.args[1] == 0:
        return user
    return None


def _bytes(node: torch.fx.Node, value_arg) -> int:
    """What keeping a record's value alive costs, in bytes (the budget where unknown)."""
    val = value_arg.meta.get("val") if isinstance(value_arg, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return BUDGET
    numel = val.numel()
    return numel * val.element_size() if isinstance(numel, int) else BUDGET


def _guarded(graph: torch.fx.Graph) -> bool:
    """Whether the graph checks a value for NaN/Inf (a ``tap`` op with the GUARD flag)."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _TAP:
            flags = node.args[4] if len(node.args) > 4 else node.kwargs.get("flags", 0)
            if not isinstance(flags, int) or flags & _ops.GUARD:
                return True
    return False


def _runs(graph: torch.fx.Graph, with_effects) -> list[list[torch.fx.Node]]:
    """Maximal runs of record ops next to one another on the token chain, cut at the budget."""
    runs: list[list[torch.fx.Node]] = []
    run: list[torch.fx.Node] = []
    held = 0

    def close() -> None:
        nonlocal run, held
        if len(run) > 1:
            runs.append(run)
        run, held = [], 0

    for node in graph.nodes:
        if node.op != "call_function" or node.target is not with_effects:
            continue
        out = _token_out(node)
        if node.args[1] not in _RECORDS or node.kwargs or out is None:
            close()  # another effect: it keeps its place between the records
            continue
        if run and node.args[0] is not _token_out(run[-1]):
            close()
        size = _bytes(node, node.args[2])
        if run and held + size > BUDGET:
            close()
        run.append(node)
        held += size
    close()
    return runs


def _merge(graph: torch.fx.Graph, run: list[torch.fx.Node], with_effects) -> None:
    """Replace ``run`` by one ``record_batch`` effect at its last place, on the same token chain."""
    values, modules, kinds, paths, flags, dtypes, shapes = [], [], [], [], [], [], []
    for node in run:
        op, args = node.args[1], node.args[2:]
        values.append(args[0])
        modules.append(args[1])
        kinds.append(args[2])
        paths.append(args[3])
        flags.append(args[4])
        if op is torch.ops.picklehooks.record_stats.default:
            shape, dtype = list(args[5]), args[6]
            dtypes.append(str(dtype).removeprefix("torch."))
            shapes += [len(shape), *shape]
        else:
            dtypes.append("")
    last_out = _token_out(run[-1])
    with graph.inserting_after(last_out):
        merged = graph.call_function(with_effects, (run[0].args[0], torch.ops.picklehooks.record_batch.default,
                                                    values, modules, kinds, paths, flags, dtypes, shapes))
        merged.meta.update(run[-1].meta)
    with graph.inserting_after(merged):
        token = graph.call_function(operator.getitem, (merged, 0))
        token.meta.update(last_out.meta)
    last_out.replace_all_uses_with(token)
    for node in reversed(run):
        graph.erase_node(_token_out(node))
        graph.erase_node(node)


def _pass_base():
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # a torch without it: a plain callable (Inductor then caches no such graph)
        return object
    return CustomGraphPass


class RecordBatching(_pass_base()):
    """Inductor post-grad pass: each run of record ops becomes one ``record_batch`` op (see the module)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        with_effects = _with_effects()
        if with_effects is None or not hasattr(torch.ops.picklehooks, "record_batch") or _aot_compiling():
            return
        runs = _runs(graph, with_effects)
        if not runs or _guarded(graph):
            return
        for run in runs:
            _merge(graph, run, with_effects)
        graph.lint()

    def uuid(self) -> str:
        """This file's and the kernel's text, with the budget: what Inductor's cache keys on."""
        digest = hashlib.sha256(str(BUDGET).encode())
        for path in (_HERE, _ops.__file__):
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.hexdigest()


def _aot_compiling() -> bool:
    """Whether Inductor is compiling ahead of time (AOTInductor), whose artifacts keep one op per record."""
    try:
        from torch._inductor.virtualized import V
    except ImportError:
        return False
    return bool(getattr(V, "aot_compilation", False))


PASS = RecordBatching()


def install() -> None:
    """Add :data:`PASS` to Inductor's post-grad passes, after any pass already there (once)."""
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    if current is None:
        config.post_grad_custom_post_pass = PASS
    elif isinstance(current, (list, tuple)):
        if PASS not in current:
            config.post_grad_custom_post_pass = [*current, PASS]
    elif current is not PASS and _takes_lists():
        config.post_grad_custom_post_pass = [current, PASS]


def _takes_lists() -> bool:
    """Whether this torch's Inductor runs a list of custom passes."""
    try:
        from torch._inductor.custom_graph_pass import get_custom_graph_passes  # noqa: F401
    except ImportError:
        return False
    return True


_ops._ON_TRACE.append(install)
