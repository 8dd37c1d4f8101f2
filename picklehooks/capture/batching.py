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
whatever order Inductor runs the graph in. The values and statistics stay valid until that
kernel returns, so the log keeps them by reference meanwhile, where one op per record must
copy each (a device value's copy, a statistics tensor's clone): it reduces them, or stacks
them, before it returns (``Rows._lend``). Other effect ops (``record_state``, ``watch``),
and record ops of CPU values (:data:`CPU_VALUES`), end a run: they keep their places.

:func:`install` adds the pass to ``torch._inductor.config.post_grad_custom_post_pass``
(after any pass already there) whenever a graph with a record op is traced while Inductor is
loaded (``picklehooks._ops._ON_TRACE``), so a ``config.patch`` that put back an earlier value
doesn't lose it, and a process that never loads Inductor (``torch.export`` alone) doesn't load it
for this. The pass changes only graphs holding picklehooks record ops; :data:`ENABLED` off, none.

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
import sys

import torch

from .. import _ops

__all__ = ["BUDGET", "CPU_VALUES", "ENABLED", "RecordBatching", "install"]

#: Whether graphs compiled from now on batch their records (the bench turns it off to compare).
ENABLED = True
#: Bytes of recorded values one batch may hold alive past their last use in the graph.
BUDGET = 32 << 20
#: Whether a ``record`` op of a CPU value joins a batch. Off: the native pass reads a CPU value
#: best right where the graph made it, in cache (the bench's compiled MLP forward recorded at 1.52x
#: of the compiled plain model with one op per record, 1.61x batched); a batch reads it later. On, a CPU
#: graph's records keep the program's order too (tests turn it on to check the merging on CPU).
CPU_VALUES = False

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


def _value(node: torch.fx.Node) -> torch.Tensor | None:
    """The fake tensor tracing gave a record op's value (its first argument), or None."""
    arg = node.args[2]
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _bytes(node: torch.fx.Node) -> int:
    """What keeping a record op's value alive costs, in bytes (the budget where unknown)."""
    val = _value(node)
    if val is None:
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


def _batched(node: torch.fx.Node) -> bool:
    """Whether this record op joins a batch: statistics the graph computed (nine numbers), or a
    value on a device (kept by reference until the batch's kernel returns: no copy of it), or on
    the CPU where :data:`CPU_VALUES` says so."""
    if node.args[1] is not torch.ops.picklehooks.record.default:
        return True
    val = _value(node)
    return val is not None and (CPU_VALUES or val.device.type != "cpu")


def _runs(graph: torch.fx.Graph, with_effects) -> list[list[torch.fx.Node]]:
    """Maximal runs of batched record ops next to one another on the token chain, cut at the budget."""
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
        if node.args[1] not in _RECORDS or node.kwargs or out is None or not _batched(node):
            close()  # another effect, or a record op kept as it is: it keeps its place between the records
            continue
        if run and node.args[0] is not _token_out(run[-1]):
            close()
        size = _bytes(node)
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
        if not ENABLED or with_effects is None or not hasattr(torch.ops.picklehooks, "record_batch") \
                or _aot_compiling():
            return
        runs = _runs(graph, with_effects)
        if not runs or _guarded(graph):
            return
        for run in runs:
            _merge(graph, run, with_effects)
        graph.lint()

    def uuid(self) -> str:
        """This file's and the kernel's text, with the budget: what Inductor's cache keys on."""
        digest = hashlib.sha256(f"{ENABLED} {BUDGET} {CPU_VALUES}".encode())
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
    """Add :data:`PASS` to Inductor's post-grad passes, after any pass already there, where Inductor
    is loaded and it isn't there yet (cheap otherwise: called whenever a record op is traced)."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return
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
