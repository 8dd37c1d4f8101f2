"""Figures of a log: activation histograms, stat heatmaps, gradient flow, comparison errors.

Every function writes one PNG and returns its path::

    from picklehooks.diagnostics import plots
    plots.activation_histograms(log, "hist.png")       # one histogram per layer (or bars of statistics)
    plots.activation_heatmap(log, "heat.png")           # layers × steps: absmax, log colour scale
    plots.gradient_flow_bars(log, "grads.png")          # ‖grad_output‖ per layer, log scale
    plots.comparison_errors(rows, "errors.png")         # relative error and SQNR per layer

``pip install 'picklehooks[plots]'`` (matplotlib). Figures are drawn on
matplotlib's non-interactive Agg canvas directly, without ``pyplot``: nothing
opens a window, and an application's own pyplot backend and figures are left
alone. A "layer" is a module's qualified name (``(root)`` for the root),
followed by ``/path`` for a value inside a tuple or dict output; layers are
shown in forward (execution) order. When a module runs several times in one
step, its calls are pooled (histograms concatenate the values; statistics are
combined: mean and std over all elements, norm as the norm of everything).

Magnitudes (``absmax``, ``norm``, ``std``) are drawn on log scales, so one
exploding layer (5e21) doesn't flatten the others (1) into one colour.

Limits: values are plotted as float64 on the host (complex values by
magnitude); NaN and Inf can't be drawn, so they are counted and marked in red
instead, and neither can 0 on a log scale (marked apart too).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping

from .._shim import PicklehooksError
from ..capture.log import Log, Record
from ..capture.record import STAT_NAMES
from ._layers import label, layers, pooled, steps_of  # also read as plots.pooled, plots.layers, ...

__all__ = ["activation_histograms", "activation_heatmap", "gradient_flow_bars", "comparison_errors"]

_SIGNED_STATS = ("mean", "min", "max")  # shown with a diverging colour map centred on zero
_MAGNITUDE_STATS = ("absmax", "norm", "std")  # never negative: a log colour scale
#: Statistics-only histograms switch from mean ± std bars to magnitudes on a log axis when the
#: layers' absmax values span at least this many orders of magnitude.
_DECADES = 3
_DPI = 100


# --------------------------------------------------------------------------
# matplotlib, lazily


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        raise PicklehooksError("plots need matplotlib: pip install 'picklehooks[plots]'") from None
    return matplotlib


def _figure(width: float, height: float):
    """A Figure on an Agg canvas (no pyplot, no window, no global backend change)."""
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path) -> Path:
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, format="png")
    return path


# --------------------------------------------------------------------------
# Helpers


def _short(text: str, width: int = 32) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _values(records: list[Record]):
    """All elements of the records' kept tensors, flattened to one float64 numpy array (or None)."""
    import torch

    kept = [r.tensor.detach() for r in records if r.tensor is not None]
    if not kept:
        return None
    flat = [(t.abs() if t.is_complex() else t).reshape(-1).to(torch.float64).cpu() for t in kept]
    return torch.cat(flat).numpy()


def _pick(n: int, at_most: int) -> list[int]:
    """``at_most`` indices spread evenly over ``range(n)``, first and last included."""
    if n <= at_most:
        return list(range(n))
    if at_most <= 1:
        return [0]
    return sorted({round(i * (n - 1) / (at_most - 1)) for i in range(at_most)})


def _need(groups: dict, kind: str, what: str, log: Log) -> None:
    if not groups:
        seen = sorted({r.kind for r in log.records if r.shape is not None}) or ["no tensors"]
        raise PicklehooksError(
            f"{what} needs {kind!r} records, but the log holds {', '.join(seen)}; instrument the model with "
            f"capture including {kind!r}")


def _rotate_labels(ax, names: list[str]) -> None:
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([_short(n) for n in names], rotation=45, ha="right", rotation_mode="anchor", fontsize=8)


# --------------------------------------------------------------------------
# The figures


def activation_histograms(log: Log, path: str | os.PathLike, *, kind: str = "output", step: int | None = None,
                          max_layers: int = 16) -> Path:
    """Histograms of each layer's values at one step; a mean ± std bar chart when no tensors were kept.

    ``step`` defaults to the last step at which ``kind`` was recorded. With
    more than ``max_layers`` layers, that many are shown, spread evenly from
    the first to the last (the bar chart always shows every layer). NaN and
    Inf are left out of a histogram and counted in red in its title. Tensors
    are kept when the log was recorded with ``mode="tensor"`` or ``"both"``.
    """
    if max_layers < 1:
        raise PicklehooksError(f"max_layers={max_layers!r}: show at least one layer")
    available = steps_of(log, kind)
    if step is None and available:
        step = available[-1]
    groups = layers(log, kind, step=step)
    if not groups and available:
        raise PicklehooksError(f"no {kind!r} records at step {step}; the log has steps {available}")
    _need(groups, kind, "activation_histograms", log)
    names = list(groups)
    if any(r.tensor is not None for g in groups.values() for r in g):
        shown = [names[i] for i in _pick(len(names), max_layers)]
        cols = min(4, len(shown))
        rows = math.ceil(len(shown) / cols)
        fig = _figure(3.3 * cols, 2.5 * rows + 0.6)
        axes = fig.subplots(rows, cols, squeeze=False)
        for i, ax in enumerate(axes.flat):
            if i >= len(shown):
                ax.set_visible(False)
                continue
            name = shown[i]
            values = _values(groups[name])
            title = _short(name, 30)
            if values is None:
                ax.text(0.5, 0.5, "no tensor kept", ha="center", va="center", transform=ax.transAxes, color="grey")
                ax.set_xticks([]), ax.set_yticks([])
                ax.set_title(title, fontsize=9)
            else:
                import numpy as np

                finite = values[np.isfinite(values)]
                if finite.size:
                    ax.hist(finite, bins=50, histtype="stepfilled", color="tab:blue", alpha=0.85)
                n_nan, n_inf = int(np.isnan(values).sum()), int(np.isinf(values).sum())
                if n_nan or n_inf:
                    ax.set_title(f"{title}\nNaN: {n_nan}  Inf: {n_inf}", fontsize=9, color="red")
                else:
                    ax.set_title(title, fontsize=9)
                ax.tick_params(labelsize=7)
                if i + cols >= len(shown):  # nothing below it
                    ax.set_xlabel("value", fontsize=8)
                if i % cols == 0:
                    ax.set_ylabel("count", fontsize=8)
        extra = f" ({len(shown)} of {len(names)} layers)" if len(shown) < len(names) else ""
        fig.suptitle(f"{kind} values at step {step}{extra}", fontsize=11)
        return _save(fig, path)

    stats = [pooled(groups[n]) for n in names]
    fig = _figure(max(6.0, 0.45 * len(names) + 2.0), 4.8)
    ax = fig.subplots()
    decades = _decades([s["absmax"] for s in stats if s])
    if decades >= _DECADES:
        _magnitude_bars(ax, names, stats)
        ax.set_ylabel(f"|{kind}| (log scale)")
        ax.set_title(f"{kind} magnitude per layer at step {step}, log scale\n(no tensors kept: record with "
                     "mode='both' for histograms)", fontsize=10)
        return _save(fig, path)
    means = [s["mean"] if s and math.isfinite(s["mean"]) else 0.0 for s in stats]
    stds = [s["std"] if s and math.isfinite(s["std"]) else 0.0 for s in stats]
    ax.bar(range(len(names)), means, yerr=stds, capsize=3, color="tab:blue", alpha=0.85, ecolor="black")
    ax.axhline(0, color="black", linewidth=0.6)
    _rotate_labels(ax, names)
    for i, s in enumerate(stats):
        if s and (s["n_nan"] or s["n_inf"]):
            ax.get_xticklabels()[i].set_color("red")
            ax.text(i, 0, "NaN" if s["n_nan"] else "Inf", color="red", ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("layer (forward order)")
    ax.set_ylabel(f"{kind} mean ± std")
    ax.set_title(f"{kind} mean ± std per layer at step {step}\n(no tensors kept: record with mode='both' "
                 "for histograms)", fontsize=10)
    return _save(fig, path)


def _decades(values) -> float:
    """How many orders of magnitude the finite positive ``values`` span (0 for fewer than two)."""
    positive = [v for v in values if math.isfinite(v) and v > 0]
    return math.log10(max(positive) / min(positive)) if len(positive) > 1 else 0.0


def _magnitude_bars(ax, names: list[str], stats: list[dict | None]) -> None:
    """Per layer on a log axis: a bar up to its absmax and a dot at its RMS (norm / sqrt(size)).

    0 can't be drawn on a log axis and NaN/Inf not at all: such layers are labelled in red.
    """
    import numpy as np

    absmax = np.array([s["absmax"] if s else np.nan for s in stats], dtype=float)
    rms = np.array([s["norm"] / math.sqrt(s["numel"]) if s and s["numel"] else np.nan for s in stats], dtype=float)
    x = np.arange(len(names))
    bars, dots = np.isfinite(absmax) & (absmax > 0), np.isfinite(rms) & (rms > 0)
    floor = float(np.concatenate([absmax[bars], rms[dots]]).min()) / 10
    ax.bar(x[bars], absmax[bars], color="tab:blue", alpha=0.85, label="absmax")
    ax.scatter(x[dots], rms[dots], color="black", s=14, zorder=3, label="RMS")
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.legend(fontsize=8, loc="best")
    _rotate_labels(ax, names)
    for i, s in enumerate(stats):
        flag = "" if not s else "NaN" if s["n_nan"] else "Inf" if s["n_inf"] else "0" if s["absmax"] == 0 else ""
        if flag:
            ax.get_xticklabels()[i].set_color("red")
            ax.text(i, 0.02, flag, color="red", ha="center", va="bottom", fontsize=8,
                    transform=ax.get_xaxis_transform())
    ax.set_xlabel("layer (forward order)")


def activation_heatmap(log: Log, path: str | os.PathLike, *, stat: str = "absmax", kind: str = "output") -> Path:
    """A layers × steps heatmap of one statistic (``mean std min max absmax norm n_nan n_inf zero_frac``).

    The default, ``absmax`` (the largest magnitude in the layer's value), is the
    magnitude that explodes first and, unlike ``norm``, doesn't grow with the
    layer's size, so layers of different widths compare. Magnitudes (``absmax``,
    ``norm``, ``std``) use a log colour scale (one layer at 5e21 leaves the
    others at 1 their own colours); a cell whose magnitude is 0, which a log
    scale can't place, is white. Signed statistics (``mean min max``) use a
    diverging colour map centred on 0, the others a linear one. Calls of a
    layer within one step are pooled. Grey cells: the layer wasn't recorded at
    that step; red crosses: the statistic is NaN there, red triangles: ±Inf.
    """
    if stat not in STAT_NAMES:
        raise PicklehooksError(f"stat={stat!r}: use one of {', '.join(STAT_NAMES)}")
    steps = steps_of(log, kind)
    groups = layers(log, kind)
    _need(groups, kind, "activation_heatmap", log)
    import numpy as np

    names = list(groups)
    column = {s: j for j, s in enumerate(steps)}
    grid = np.full((len(names), len(steps)), np.nan)
    recorded = np.zeros(grid.shape, dtype=bool)
    for i, name in enumerate(names):
        by_step: dict[int, list[Record]] = {}
        for rec in groups[name]:
            by_step.setdefault(rec.step, []).append(rec)
        for s, recs in by_step.items():
            p = pooled(recs)
            if p is not None:
                grid[i, column[s]] = float(p[stat])
                recorded[i, column[s]] = True
    finite = grid[np.isfinite(grid)]
    positive = finite[finite > 0]
    zero = np.zeros(grid.shape, dtype=bool)
    matplotlib = _matplotlib()
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Patch

    fig = _figure(min(max(6.0, 0.3 * len(steps) + 4.0), 22.0), min(max(3.2, 0.32 * len(names) + 1.8), 30.0))
    ax = fig.subplots()
    scale = ""
    if stat in _SIGNED_STATS:
        cmap = matplotlib.colormaps["coolwarm"].with_extremes(bad="lightgrey")
        lim = float(np.abs(finite).max()) if finite.size else 1.0
        lim = lim or 1.0
        image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=-lim, vmax=lim,
                          interpolation="nearest")
    elif stat in _MAGNITUDE_STATS and positive.size:
        low, high = float(positive.min()), float(positive.max())
        zero = recorded & (grid == 0)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey", under="white")
        # Zeros go below the scale, to the "under" colour (LogNorm would mask them, as grey).
        shown = np.ma.masked_invalid(np.where(zero, low / 10, grid))
        norm = LogNorm(vmin=low, vmax=high if high > low else low * 10)
        image = ax.imshow(shown, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        scale = ", log scale"
    else:
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
        image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, interpolation="nearest")
    handles = []
    for marker, cells, what in (("x", recorded & np.isnan(grid), "NaN"), ("^", recorded & np.isinf(grid), "±Inf")):
        if cells.any():
            rows, cols = np.nonzero(cells)
            handles.append(ax.scatter(cols, rows, marker=marker, color="red", s=40, linewidths=1.5, label=what))
    if zero.any():
        handles.append(Patch(facecolor="white", edgecolor="black", label="0"))
    if (~recorded).any():
        handles.append(Patch(facecolor="lightgrey", label="not recorded"))
    if handles:  # above the axes, under the title (a suptitle: constrained layout makes room for both)
        ax.legend(handles=handles, loc="lower right", fontsize=8, bbox_to_anchor=(1.0, 1.0), frameon=False,
                  ncols=len(handles), borderaxespad=0.2)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([_short(n) for n in names], fontsize=8)
    every = max(1, math.ceil(len(steps) / 25))
    ax.set_xticks(range(0, len(steps), every))
    ax.set_xticklabels([str(steps[j]) for j in range(0, len(steps), every)], rotation=45, ha="right",
                       rotation_mode="anchor", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("layer (forward order)")
    fig.suptitle(f"{stat} of {kind} per layer and step{scale}", fontsize=11)
    fig.colorbar(image, ax=ax, label=f"{stat} of {kind}{scale}", extend="min" if zero.any() else "neither")
    return _save(fig, path)


def gradient_flow_bars(log: Log, path: str | os.PathLike, *, kind: str = "grad_output") -> Path:
    """Per-layer L2 norm of the gradient (``grad_output`` by default), log scale.

    Bars are the median over steps of each layer's norm (a step's calls
    pooled), whiskers the minimum and maximum. A layer whose median norm is 0,
    or with any NaN/Inf norm, is labelled in red (a log scale can't draw 0,
    and non-finite norms are left out of its bar).
    A norm falling by orders of magnitude towards the first layers is a
    vanishing gradient; a rising one, exploding.
    """
    groups = layers(log, kind)
    _need(groups, kind, "gradient_flow_bars", log)
    import numpy as np

    names = list(groups)
    med, lo, hi, flags = [], [], [], []
    n_steps = 0
    for name in names:
        by_step: dict[int, list[Record]] = {}
        for rec in groups[name]:
            by_step.setdefault(rec.step, []).append(rec)
        norms = np.array([p["norm"] for recs in by_step.values() if (p := pooled(recs)) is not None], dtype=float)
        n_steps = max(n_steps, len(norms))
        if not norms.size:
            flags.append("no stats")
        elif not np.isfinite(norms).all():
            flags.append("NaN/Inf")
        elif np.median(norms) == 0:
            flags.append("0")
        else:
            flags.append("")
        finite = norms[np.isfinite(norms)]
        med.append(float(np.median(finite)) if finite.size else np.nan)
        lo.append(float(finite.min()) if finite.size else np.nan)
        hi.append(float(finite.max()) if finite.size else np.nan)
    med, lo, hi = np.array(med), np.array(lo), np.array(hi)
    fig = _figure(max(6.0, 0.45 * len(names) + 2.0), 4.8)
    ax = fig.subplots()
    drawn = np.isfinite(med) & (med > 0)
    x = np.arange(len(names))
    if drawn.any():
        positive = np.concatenate([lo[drawn][lo[drawn] > 0], med[drawn]])
        floor = float(positive.min()) / 10
        low = np.maximum(lo[drawn], floor)  # a zero minimum can't be drawn: its whisker ends at the floor
        ax.bar(x[drawn], med[drawn], color="tab:orange", alpha=0.85,
               yerr=np.vstack([med[drawn] - low, hi[drawn] - med[drawn]]), capsize=3, ecolor="black")
    else:
        floor = 1e-12
    ax.set_yscale("log")
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylim(bottom=floor)
    _rotate_labels(ax, names)
    for i, flag in enumerate(flags):
        if flag:
            ax.get_xticklabels()[i].set_color("red")
            ax.text(i, 0.02, flag, color="red", ha="center", va="bottom", fontsize=8,
                    transform=ax.get_xaxis_transform())
    ax.set_xlabel("layer (forward order)")
    ax.set_ylabel(f"‖{kind}‖₂ (log scale)")
    span = f"median over {n_steps} steps, whiskers min–max" if n_steps > 1 else "one step"
    ax.set_title(f"gradient flow: ‖{kind}‖ per layer\n({span})", fontsize=11)
    return _save(fig, path)


def comparison_errors(rows, path: str | os.PathLike) -> Path:
    """Per-layer relative error (log scale) and SQNR (dB) from comparison rows.

    ``rows`` are dicts with ``module``, ``rel_error`` (or ``rel_err``, as
    :func:`picklehooks.diagnostics.compare` writes it) and ``sqnr_db``, in the
    order to plot; a :class:`~picklehooks.diagnostics.Comparison` (its
    ``rows``) or a pandas DataFrame works too. Other keys are ignored, except
    ``path``, ``kind`` and ``call``, which name a point when they vary. Exact
    matches (relative error 0, SQNR ∞) are green triangles at the edge, NaN
    red crosses, no match at all (relative error ∞, SQNR -∞) red triangles;
    ``None`` (not computed, e.g. SQNR from statistics only) is left out.
    """
    if hasattr(rows, "rows") and not isinstance(rows, Mapping):
        rows = rows.rows
    if hasattr(rows, "to_dict") and not isinstance(rows, Mapping):
        rows = rows.to_dict("records")
    rows = list(rows)
    if not rows:
        raise PicklehooksError("comparison_errors needs at least one row (dicts with module, rel_error, sqnr_db)")
    rel_key = "rel_error" if all("rel_error" in r for r in rows) else "rel_err"
    missing = [k for k in ("module", rel_key, "sqnr_db") if any(k not in r for r in rows)]
    if missing:
        raise PicklehooksError(f"comparison_errors: rows lack {', '.join(missing)}; each row needs module, "
                               "rel_error (or rel_err) and sqnr_db")
    varying = [k for k in ("kind", "call") if len({r.get(k) for r in rows}) > 1]
    names = []
    for r in rows:
        name = label(str(r["module"]), str(r.get("path") or ""))
        extra = ", ".join(f"{r.get(k)}" if k == "kind" else f"call {r.get(k)}" for k in varying)
        names.append(f"{name} [{extra}]" if extra else name)

    def number(value) -> float | None:
        if value is None:
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            return math.nan

    rel = [number(r[rel_key]) for r in rows]
    sqnr = [number(r["sqnr_db"]) for r in rows]
    fig = _figure(max(6.5, 0.45 * len(rows) + 2.0), 6.5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    x = list(range(len(rows)))

    def series(ax, values, good, exact, worst, worst_at, colour):
        x_ = [i for i, v in zip(x, values) if v is not None]
        values = [v for v in values if v is not None]
        pts = [(i, v) for i, v in zip(x_, values) if good(v)]
        if pts:
            ax.plot([i for i, _ in pts], [v for _, v in pts], "o-", color=colour, markersize=4)
        edge = ax.get_xaxis_transform()
        ex = [i for i, v in zip(x_, values) if exact(v)]
        if ex:
            ax.scatter(ex, [0.95] * len(ex), marker="^", color="green", transform=edge, label="exact", zorder=3)
        nan = [i for i, v in zip(x_, values) if math.isnan(v)]
        if nan:
            ax.scatter(nan, [0.05] * len(nan), marker="x", color="red", transform=edge, label="NaN", zorder=3)
        bad = [i for i, v in zip(x_, values) if worst(v)]
        if bad:
            ax.scatter(bad, [worst_at] * len(bad), marker="^" if worst_at > 0.5 else "v", color="red",
                       transform=edge, label="no match (shapes differ, NaN on one side)", zorder=3)
        if ex or nan or bad:
            ax.legend(fontsize=8, loc="best")
        ax.grid(True, alpha=0.3)

    series(top, rel, lambda v: math.isfinite(v) and v > 0, lambda v: v == 0, lambda v: v == math.inf, 0.95,
           "tab:red")
    if any(v is not None and math.isfinite(v) and v > 0 for v in rel):
        top.set_yscale("log")
    top.set_ylabel("relative error (log scale)")
    top.set_title("per-layer error: relative error (top), SQNR (bottom)", fontsize=11)
    series(bottom, sqnr, math.isfinite, lambda v: v == math.inf, lambda v: v == -math.inf, 0.05, "tab:blue")
    bottom.set_ylabel("SQNR (dB, higher is better)")
    bottom.set_xlabel("layer")
    _rotate_labels(bottom, names)
    return _save(fig, path)
