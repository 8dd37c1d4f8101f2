"""``python -m picklehooks report`` and picklehooks.diagnostics.report / plots.

A log with a planted NaN (one module turns part of its input into NaN at one
step) is saved; the report must name that module as the first non-finite
value, list every layer, and write PNGs that are valid images.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.diagnostics import plots
from picklehooks.diagnostics.report import write_report
from tests.testutils import REPO, run_fresh

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="figures need matplotlib (pip install 'picklehooks[plots]')")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NAN_STEP = 1


class PlantNan(nn.Module):
    """Identity, except at the step when ``armed``: then its first output row is NaN."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        if not self.armed:
            return x * 1.0
        return torch.cat([torch.full_like(x[:1], float("nan")), x[1:]])


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), PlantNan(), nn.Tanh(), nn.Linear(8, 2))


def record_log(mode: str = "both", steps: int = 3) -> picklehooks.Log:
    model = make_model()
    handle = picklehooks.instrument(model, capture=("output", "grad_output", "param_grad"), mode=mode)
    with picklehooks.record() as log:
        for step in range(steps):
            model[3].armed = step == NAN_STEP
            model.zero_grad()
            model(torch.randn(4, 3)).square().sum().backward()
            log.next_step()
    handle.remove()
    return log


#: Output scales of the branches of ScaledFan: one exploding, one zero, the others near 1.
SCALES = (1.0, 5e21, 3.0, 0.2, 0.0)


class ScaledFan(nn.Module):
    """Its input times each of SCALES, one branch module each."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(Scale(k) for k in SCALES)

    def forward(self, x):
        return [branch(x) for branch in self.branches]


class Scale(nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


def record_scaled(mode: str, steps: int = 3) -> picklehooks.Log:
    """ScaledFan over ``steps`` steps, NaN input at NAN_STEP."""
    model = ScaledFan()
    with picklehooks.instrument(model, capture="output", mode=mode), picklehooks.record() as log:
        for step in range(steps):
            x = torch.linspace(-1, 1, 8) * (1 + step / 10)
            model(torch.full_like(x, math.nan) if step == NAN_STEP else x)
            log.next_step()
    return log


def keep_figures(monkeypatch) -> list:
    """Make plots keep each figure it saves (in the returned list), to read its images and axes."""
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    return figures


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "picklehooks", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=240)


def check_png(path) -> None:
    data = open(path, "rb").read()
    assert data[:8] == PNG_SIGNATURE, path
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] >= 100 and image.shape[1] >= 100, (path, image.shape)
    assert image[..., :3].std() > 0.01, f"{path} is blank"


@needs_matplotlib
def test_report_cli_names_the_planted_nan(tmp_path):
    """The CLI writes report.md naming module 3 (step 1) as the first non-finite value, and valid PNGs."""
    log_dir, out = tmp_path / "log", tmp_path / "report"
    record_log().save(log_dir)
    proc = run_cli("report", str(log_dir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    written = [line for line in proc.stdout.splitlines() if line]
    assert written[0].endswith("report.md") and all(os.path.exists(p) for p in written)
    text = (out / "report.md").read_text()
    first = next(line for line in text.splitlines() if line.startswith("**First non-finite value**"))
    assert "`3` output" in first and f"step {NAN_STEP}" in first and "8 NaN" in first
    outputs = text.split("## Outputs at step")[1].split("##")[0]
    for module in ("0", "1", "2", "3", "4", "5"):
        assert f"\n| {module} | (4, " in outputs, module
    assert "## Gradient flow (grad_output)" in text and "## Parameter gradients" in text
    pngs = sorted(p for p in out.iterdir() if p.suffix == ".png")
    assert {p.name for p in pngs} >= {"activation_histograms.png", "activation_heatmap.png", "gradient_flow.png",
                                      f"activation_histograms_step{NAN_STEP}.png"}
    assert sorted(map(str, pngs)) == sorted(p for p in written if p.endswith(".png"))
    for png in pngs:
        assert f"]({png.name})" in text
        check_png(png)


@pytest.mark.parametrize("bad", ["missing", "file", "not_json", "not_a_log"])
def test_report_cli_bad_log(tmp_path, bad):
    """A LOG that isn't a saved log: exit 1, one line on stderr, no traceback, nothing written."""
    log_dir = tmp_path / "log"
    if bad == "file":
        log_dir.write_text("hello")
    elif bad != "missing":
        log_dir.mkdir()
        (log_dir / "records.json").write_text("{" if bad == "not_json" else '{"format": "other"}')
    proc = run_cli("report", str(log_dir), "--out", str(tmp_path / "out"))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("picklehooks report: error:") and "Traceback" not in proc.stderr
    assert str(log_dir) in lines[0]
    assert not (tmp_path / "out").exists()


@needs_matplotlib
def test_write_report_stats_only_single_step(tmp_path):
    """Statistics only, one step, no NaN: tables, mean ± std bars instead of histograms, no heatmap."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    picklehooks.instrument(model, capture=("output",))
    with picklehooks.record() as log:
        model(torch.randn(2, 3))
    paths = write_report(log, tmp_path)
    assert [p.name for p in paths] == ["report.md", "activation_histograms.png"]
    text = paths[0].read_text()
    assert "No NaN or Inf in any recorded value." in text and "Gradient flow" not in text
    check_png(paths[1])


@needs_matplotlib
class TestPlots:
    def test_each_figure_is_a_png(self, tmp_path):
        log = record_log(mode="stats")
        written = [
            plots.activation_histograms(log, tmp_path / "bars.png"),
            plots.activation_histograms(record_log(), tmp_path / "sub" / "hist.png", step=NAN_STEP, max_layers=4),
            plots.activation_heatmap(log, tmp_path / "heat.png", stat="absmax"),
            plots.gradient_flow_bars(log, tmp_path / "grads.png"),
            plots.comparison_errors([{"module": "a", "rel_error": 1e-3, "sqnr_db": 60.0},
                                     {"module": "b", "rel_error": 0.0, "sqnr_db": math.inf},
                                     {"module": "c", "rel_error": math.nan, "sqnr_db": math.nan},
                                     {"module": "d", "rel_error": 0.2, "sqnr_db": 14.0}], tmp_path / "cmp.png"),
        ]
        for path in written:
            check_png(path)

    def test_comparison_errors_from_compare(self, tmp_path):
        """The rows of diagnostics.compare (rel_err, sqnr_db) plot as they are, and a Comparison does too."""
        from picklehooks.diagnostics import compare, record_forward

        model = make_model()
        pruned = make_model()
        with torch.no_grad():
            pruned[2].weight[:, :4] = 0  # a planted change from layer 2 on
        x = torch.randn(4, 3)
        result = compare(record_forward(model, x), record_forward(pruned, x))
        assert "rel_err" in result.rows[0] and result.first_divergence["module"] == "2"
        check_png(plots.comparison_errors(result.rows, tmp_path / "rows.png"))
        check_png(plots.comparison_errors(result, tmp_path / "comparison.png"))

    def test_missing_records_say_what_to_capture(self, tmp_path):
        model = nn.Sequential(nn.Linear(3, 4))
        picklehooks.instrument(model, capture=("output",))
        with picklehooks.record() as log:
            model(torch.randn(2, 3))
        with pytest.raises(picklehooks.PicklehooksError, match="capture including 'grad_output'"):
            plots.gradient_flow_bars(log, tmp_path / "g.png")
        with pytest.raises(picklehooks.PicklehooksError, match="no 'output' records at step 5"):
            plots.activation_histograms(log, tmp_path / "h.png", step=5)
        with pytest.raises(picklehooks.PicklehooksError, match="stat='median'"):
            plots.activation_heatmap(log, tmp_path / "m.png", stat="median")
        with pytest.raises(picklehooks.PicklehooksError, match="lack sqnr_db"):
            plots.comparison_errors([{"module": "a", "rel_error": 0.1}], tmp_path / "c.png")

    def test_heatmap_of_an_exploding_layer_keeps_the_others_apart(self, tmp_path, monkeypatch):
        """One layer at 5e21, others near 1: absmax on a log colour scale gives each its own colour;
        a zero layer is the "under" colour, a NaN step is marked; signed means stay linear."""
        from matplotlib.colors import LogNorm

        log = record_scaled(mode="stats")
        figures = keep_figures(monkeypatch)
        plots.activation_heatmap(log, tmp_path / "heat.png")
        ax = figures[-1].axes[0]
        image = ax.images[0]
        assert isinstance(image.norm, LogNorm)
        names = [t.get_text() for t in ax.get_yticklabels()]
        assert names == [f"branches.{i}" for i in range(len(SCALES))]
        grid = image.get_array()
        colours = image.cmap(image.norm(grid))
        finite = [j for j in range(grid.shape[1]) if j != NAN_STEP]
        assert len(finite) == 2
        cells = {scale: {tuple(colours[i, j]) for j in finite} for i, scale in enumerate(SCALES)}
        for a in SCALES:
            for b in SCALES:
                assert a == b or not cells[a] & cells[b], (a, b)
        assert cells[0.0] == {tuple(image.cmap.get_under())} != {tuple(image.cmap.get_bad())}
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["NaN", "0"]
        assert sorted({int(x) for x, _ in ax.collections[0].get_offsets()}) == [NAN_STEP]
        plots.activation_heatmap(log, tmp_path / "mean.png", stat="mean")
        assert not isinstance(figures[-1].axes[0].images[0].norm, LogNorm)

    def test_bars_of_an_exploding_layer_are_magnitudes_on_a_log_axis(self, tmp_path, monkeypatch):
        """Without kept tensors: absmax bars on a log axis when layers are orders of magnitude apart,
        mean ± std bars on a linear one when they aren't."""
        figures = keep_figures(monkeypatch)
        log = record_scaled(mode="stats")
        plots.activation_histograms(log, tmp_path / "bars.png", step=0)
        ax = figures[-1].axes[0]
        assert ax.get_yscale() == "log"
        absmax = [plots.pooled(g)["absmax"] for g in plots.layers(log, "output", step=0).values()]
        assert [p.get_height() for p in ax.patches] == pytest.approx([a for a in absmax if a > 0])
        assert max(absmax) > 1e21 and min(a for a in absmax if a > 0) < 1
        plots.activation_histograms(record_log(mode="stats"), tmp_path / "plain.png")
        assert figures[-1].axes[0].get_yscale() == "linear"

    def test_pooled_statistics_of_several_calls(self):
        """Two calls pooled: mean, std and norm equal those of the concatenated values."""
        a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-4.0, 10.0])
        model = nn.Sequential(nn.Identity())
        picklehooks.instrument(model, capture=("output",))
        with picklehooks.record() as log:
            model(a), model(b)
        s = plots.pooled(log.records)
        both = torch.cat([a, b])
        assert s["calls"] == 2 and s["numel"] == 5
        assert s["mean"] == pytest.approx(float(both.mean()))
        assert s["std"] == pytest.approx(float(both.std(unbiased=False)))
        assert s["norm"] == pytest.approx(float(both.norm())) and s["absmax"] == 10.0 and s["min"] == -4.0


NO_MATPLOTLIB = """
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'matplotlib':
            raise ImportError('no matplotlib here')
sys.meta_path.insert(0, _Refuse())
import torch, picklehooks
from picklehooks.diagnostics import plots
from picklehooks.diagnostics.report import write_report
log = picklehooks.Log.load(sys.argv[1])
try:
    plots.gradient_flow_bars(log, sys.argv[2] + '/g.png')
except picklehooks.PicklehooksError as exc:
    print('error:', exc)
paths = write_report(log, sys.argv[2])
print([p.name for p in paths])
print(open(paths[0]).read().split('## Figures')[1].strip())
"""


def test_without_matplotlib(tmp_path):
    """No matplotlib: plots raise naming the extra to install; the report is written without figures."""
    record_log(mode="stats").save(tmp_path / "log")
    out = run_fresh(NO_MATPLOTLIB, str(tmp_path / "log"), str(tmp_path / "out")).splitlines()
    assert out[0] == "error: plots need matplotlib: pip install 'picklehooks[plots]'"
    assert out[1] == "['report.md']"
    assert out[2].startswith("Figures skipped: plots need matplotlib: pip install 'picklehooks[plots]'")
