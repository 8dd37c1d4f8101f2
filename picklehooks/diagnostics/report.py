"""A Markdown report of a saved log: per-layer tables, non-finite findings and figures.

::

    from picklehooks.diagnostics.report import write_report
    write_report("run1", "run1-report")        # a directory Log.save() wrote, or a Log

    $ python -m picklehooks report run1 --out run1-report

writes ``report.md`` with

* the first non-finite value in execution order (the record where a NaN or
  Inf first appeared, usually the layer to look at) and every record holding one;
* per-layer statistics of the outputs at the last step (mean, std, absmax,
  NaN and Inf counts ``n_nan``/``n_inf``, fraction of zeros);
* gradient flow (``grad_output`` norms per layer: last step, median, min,
  max over steps) and parameter-gradient norms, when the log has them;

and the figures of :mod:`picklehooks.diagnostics.plots` that apply:
activation histograms (or bars of statistics: mean ± std, or magnitudes on a
log scale when layers are orders of magnitude apart) and gradient flow bars,
and a heatmap of output magnitudes (absmax, log colour scale) over steps when
the log spans several steps.
Without matplotlib (``pip install 'picklehooks[plots]'``) the report is
written without figures and says so.

Limits: a module's calls within one step are pooled into one row (see
:func:`picklehooks.diagnostics.plots.pooled`); records of non-tensor values
are left out.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from .._shim import PicklehooksError
from ..capture.log import Log, Record
from ._common import stats_of
from .nonfinite import first_nonfinite
from ._layers import label, layers, pooled, steps_of

__all__ = ["write_report", "main"]

#: At most this many non-finite records are listed (the first one is always shown).
MAX_NONFINITE_ROWS = 20


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.4g}"
    return str(value)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (control characters escaped, pipes and backticks too)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")


def _code(text: str) -> str:
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    right = {i for i, h in enumerate(header) if i > 0 and h not in ("layer", "module", "parameter", "kind", "path", "shape")}
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---:" if i in right else ":---" for i in range(len(header))) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _nonfinite(rec: Record) -> tuple[int, int] | None:
    stats = stats_of(rec)
    if stats is None or not (stats["n_nan"] or stats["n_inf"]):
        return None
    return int(stats["n_nan"]), int(stats["n_inf"])


def _where(rec: Record) -> str:
    parts = [f"{_code(label(rec.module))} {rec.kind}"]
    if rec.path:
        parts.append(f"path {_code(rec.path)}")
    parts.append(f"call {rec.call}, step {rec.step}")
    if rec.rank is not None:
        parts.append(f"rank {rec.rank}")
    if rec.source is not None:
        parts.append(f"called at {_code(rec.source)}")
    return ", ".join(parts)


def _nonfinite_section(log: Log) -> list[str]:
    found = [(i, rec, counts) for i, rec in enumerate(log.records) if (counts := _nonfinite(rec)) is not None]
    lines = ["## Non-finite values", ""]
    if not found:
        return lines + ["No NaN or Inf in any recorded value.", ""]
    i, rec, (nan, inf) = found[0]
    size = math.prod(rec.shape) if rec.shape is not None else 0
    lines += [f"**First non-finite value** (record {i} in execution order): {_where(rec)}: "
              f"{nan} NaN and {inf} Inf of {size} values.", ""]
    first = first_nonfinite(log)  # the first input, output or gradient, with what it means
    if first is not None:
        key = (first.module, first.kind, first.path, first.call, first.step)
        j, same = next((j, r) for j, r, _ in found if (r.module, r.kind, r.path, r.call, r.step) == key)
        note = _cell(first.note)
        if same is not rec:
            lines += [f"First non-finite input, output or gradient (record {j}): {_where(same)}.", ""]
        lines += [f"{note[:1].upper()}{note[1:]} ({first.phase}).", ""]
    kinds = sorted({r.kind for _, r, _ in found})
    lines += [f"{len(found)} of {len(log.records)} records hold NaN or Inf ({', '.join(kinds)})"
              + (f"; the first {MAX_NONFINITE_ROWS}:" if len(found) > MAX_NONFINITE_ROWS else ":"), ""]
    rows = [[str(i), _cell(label(r.module)), r.kind, _cell(r.path), str(r.call), str(r.step), str(n), str(f)]
            for i, r, (n, f) in found[:MAX_NONFINITE_ROWS]]
    return lines + _table(["record", "module", "kind", "path", "call", "step", "n_nan", "n_inf"], rows) + [""]


def _outputs_section(log: Log) -> list[str]:
    steps = steps_of(log, "output")
    if not steps:
        return ["## Outputs", "", "No outputs recorded (instrument with capture including 'output').", ""]
    step = steps[-1]
    rows = []
    for name, recs in layers(log, "output", step=step).items():
        s = pooled(recs)
        if s is None:
            rows.append([_cell(name), _cell(str(tuple(recs[-1].shape))), str(len(recs))] + [""] * 6)
            continue
        rows.append([_cell(name), _cell(str(tuple(recs[-1].shape))), str(s["calls"])]
                    + [_fmt(s[k]) for k in ("mean", "std", "absmax", "n_nan", "n_inf", "zero_frac")])
    header = ["layer", "shape", "calls", "mean", "std", "absmax", "n_nan", "n_inf", "zero_frac"]
    span = f" (of steps {steps[0]}–{steps[-1]})" if len(steps) > 1 else ""
    return [f"## Outputs at step {step}{span}", ""] + _table(header, rows) + [""]


def _gradient_section(log: Log) -> list[str]:
    groups = layers(log, "grad_output")
    if not groups:
        return []
    last = steps_of(log, "grad_output")[-1]
    rows = []
    for name, recs in groups.items():
        by_step: dict[int, list[Record]] = {}
        for rec in recs:
            by_step.setdefault(rec.step, []).append(rec)
        per_step = {s: p for s, rs in by_step.items() if (p := pooled(rs)) is not None}
        norms = sorted(p["norm"] for p in per_step.values())
        finite = [n for n in norms if math.isfinite(n)]
        median = _median(finite) if finite else math.nan
        bad = sum(p["n_nan"] + p["n_inf"] for p in per_step.values())
        rows.append([_cell(name), _fmt(per_step[last]["norm"]) if last in per_step else "", _fmt(median),
                     _fmt(min(finite)) if finite else "", _fmt(max(finite)) if finite else "",
                     str(len(per_step)), str(bad)])
    header = ["layer", f"norm at step {last}", "median", "min", "max", "steps", "n_nan+n_inf"]
    lines = ["## Gradient flow (grad_output)", "",
             "L2 norm of the gradient reaching each layer's output, forward order; median, min and max over "
             "steps (finite values). Norms shrinking by orders of magnitude towards the first layers "
             "mean vanishing gradients; growing, exploding.", ""]
    return lines + _table(header, rows) + [""]


def _param_grad_section(log: Log) -> list[str]:
    steps = steps_of(log, "param_grad")
    if not steps:
        return []
    step = steps[-1]
    rows = []
    for recs in layers(log, "param_grad", step=step).values():  # forward order of their modules
        s = stats_of(recs[-1]) or {}  # .grad accumulates: its latest value is the step's
        rows.append([_cell(label(recs[0].module)), _cell(recs[0].path), _fmt(s.get("norm")), _fmt(s.get("absmax")),
                     _fmt(s.get("n_nan")), _fmt(s.get("n_inf"))])
    return ([f"## Parameter gradients at step {step}", "",
             "Each parameter's accumulated `.grad` after the step's last backward pass.", ""]
            + _table(["module", "parameter", "norm", "absmax", "n_nan", "n_inf"], rows) + [""])


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _figures(log: Log, out: Path) -> tuple[list[Path], list[str]]:
    """Write the figures that apply; return them and the report's lines about them."""
    from . import plots

    jobs = []
    if steps_of(log, "output"):
        jobs.append(("activation_histograms.png", "Output values per layer (last step)", plots.activation_histograms))
        first_bad = next((r for r in log.records if r.kind == "output" and _nonfinite(r)), None)
        if first_bad is not None and first_bad.step != steps_of(log, "output")[-1]:
            bad_step = first_bad.step
            jobs.append((f"activation_histograms_step{bad_step}.png",
                         f"Output values per layer at step {bad_step} (first non-finite output)",
                         lambda log, path: plots.activation_histograms(log, path, step=bad_step)))
        if len(steps_of(log, "output")) > 1:
            jobs.append(("activation_heatmap.png", "Output magnitude (absmax, log scale) per layer and step",
                         plots.activation_heatmap))
    if steps_of(log, "grad_output"):
        jobs.append(("gradient_flow.png", "Gradient flow", plots.gradient_flow_bars))
    if not jobs:
        return [], []
    try:
        plots._matplotlib()
    except PicklehooksError as exc:
        return [], ["## Figures", "", f"Figures skipped: {exc}.", ""]
    written, lines = [], ["## Figures", ""]
    for filename, title, draw in jobs:
        written.append(draw(log, out / filename))
        lines += [f"### {title}", "", f"![{title}]({filename})", ""]
    return written, lines


def write_report(log_dir_or_log: Log | str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write ``report.md`` and its figures into ``out_dir``; return their paths (``report.md`` first).

    ``log_dir_or_log`` is a :class:`~picklehooks.Log` or a directory written by
    :meth:`Log.save <picklehooks.Log.save>`.
    """
    if isinstance(log_dir_or_log, Log):
        return _write(log_dir_or_log, Path(out_dir), "a Log in memory")
    return _write(Log.load(log_dir_or_log), Path(out_dir), _code(os.fspath(log_dir_or_log)))


def _write(log: Log, out: Path, source: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    tensor_records = [r for r in log.records if r.shape is not None]
    kinds: dict[str, int] = {}
    for rec in log.records:
        kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
    steps = sorted({r.step for r in log.records})
    lines = ["# picklehooks report", "",
             f"Log: {source}: {len(log.records)} records ({len(tensor_records)} tensors), "
             + (f"steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "no steps")
             + (", kinds: " + ", ".join(f"{k} ({n})" for k, n in kinds.items()) if kinds else "") + ".", ""]
    lines += _nonfinite_section(log)
    lines += _outputs_section(log)
    lines += _gradient_section(log)
    lines += _param_grad_section(log)
    figures, figure_lines = _figures(log, out)
    lines += figure_lines
    report = out / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return [report, *figures]


def main(log_dir: str, out_dir: str) -> int:
    """``python -m picklehooks report LOG --out DIR``: print the files written; 1 on a bad LOG."""
    from ..audit import _printable, _write as say

    try:
        log = Log.load(log_dir)
    except PicklehooksError as exc:  # its message names the directory
        message = str(exc)
    except Exception as exc:  # noqa: BLE001 - anything unreadable in LOG is one line, not a traceback
        message = f"{os.fspath(log_dir)!r} is not a readable picklehooks log ({type(exc).__name__}: {exc})"
    else:
        message = None
    if message is not None:
        say(f"picklehooks report: error: {_printable(message, one_line=True)}", sys.stderr)
        return 1
    try:
        paths = _write(log, Path(out_dir), _code(os.fspath(log_dir)))
    except (PicklehooksError, OSError) as exc:
        say(f"picklehooks report: error: {_printable(str(exc), one_line=True)}", sys.stderr)
        return 1
    for path in paths:
        say(_printable(os.fspath(path), one_line=True))
    return 0
