"""MLflow: per-layer statistics as run metrics, and instrumented models through a real registry.

Metrics: ``picklehooks.integrations.mlflow.log_metrics`` (``log.to_mlflow()``) into a real local tracking
store (SQLite), read back with ``MlflowClient.get_metric_history`` and compared with float64
statistics of what plain PyTorch hooks see on an un-instrumented copy.

Models: an instrumented model logged with ``mlflow.pytorch.log_model`` and registered in a local
registry (SQLite tracking store, local artifact store, no server) records, after
``mlflow.pytorch.load_model("models:/NAME/1")`` in a fresh process, what it recorded before logging:
pickled (the loading host finds picklehooks installed, or shipped inside the model with
``code_paths``), and exported with MLflow's default ``serialization_format="pt2"`` (the loading
process imports picklehooks first).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import warnings

import pytest
import torch
from torch import nn

mlflow = pytest.importorskip("mlflow")
import mlflow.pytorch  # noqa: E402

import picklehooks  # noqa: E402
import picklehooks.integrations.mlflow as phm  # noqa: E402
from picklehooks import PicklehooksError  # noqa: E402
from picklehooks.capture.log import STAT_NAMES  # noqa: E402

from tests.testutils import plain_stats, run_fresh  # noqa: E402

# MLflow's SQLite store on SQLAlchemy 2.1 warns about its own mapper options; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

# Quiet, offline MLflow; the children inherit these through the environment.
MLFLOW_ENV = {
    "MLFLOW_LOGGING_LEVEL": "ERROR",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # A failed requirements inference raises instead of falling back to MLflow's defaults.
    "MLFLOW_REQUIREMENTS_INFERENCE_RAISE_ERRORS": "true",
}

# Load a registered model with MLflow alone, then record one forward + backward; save the log.
CHILD = """
import sys, torch
import mlflow.pytorch
model = mlflow.pytorch.load_model(sys.argv[1])
import picklehooks
x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
with picklehooks.record() as log:
    torch.nn.functional.cross_entropy(model(x), torch.arange(6) % 3).backward()
log.save(sys.argv[2])
print(picklehooks.__file__)
"""

# A host where picklehooks is not installed: only a copy under a model's code/ directory
# (the directory MLflow puts on sys.path for ``code_paths``) can be imported.
ONLY_SHIPPED_PICKLEHOOKS = """
import importlib.machinery, os, sys
class _OnlyShippedPicklehooks:
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] != 'picklehooks':
            return None
        if name != 'picklehooks':  # submodules: only inside the package that was imported
            return importlib.machinery.PathFinder.find_spec(name, path)
        shipped = [p for p in sys.path if os.path.basename(p) == 'code']
        spec = importlib.machinery.PathFinder.find_spec(name, shipped)
        if spec is None:
            raise ImportError('picklehooks is not installed on this host')
        return spec
sys.meta_path.insert(0, _OnlyShippedPicklehooks())
"""


def pickle_format() -> dict:
    """``serialization_format="pickle"`` where MLflow has the argument (its default there is "pt2")."""
    params = inspect.signature(mlflow.pytorch.log_model).parameters
    return {"serialization_format": "pickle"} if "serialization_format" in params else {}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """A fresh local registry: ``MLFLOW_TRACKING_URI`` is ``sqlite:///<tmp>/mlflow.db`` here and in children."""
    tmp = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in MLFLOW_ENV.items():
            mp.setenv(key, value)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")
        yield mlflow.create_experiment("picklehooks", artifact_location=(tmp / "artifacts").as_uri())


def instrumented_and_recorded() -> tuple[nn.Module, picklehooks.Log]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    picklehooks.instrument(model, capture="all")
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with picklehooks.record() as log:
        nn.functional.cross_entropy(model(x), torch.arange(6) % 3).backward()
    for record in log.records:
        record.stats  # read them now: the model keeps changing (gradients)
    return model, log


def register(model: nn.Module, experiment: str, name: str, **kwargs) -> list[str]:
    """Log ``model`` as version 1 of ``name``; return the requirements.txt lines MLflow wrote."""
    with mlflow.start_run(experiment_id=experiment):
        info = mlflow.pytorch.log_model(model, name="model", registered_model_name=name, **pickle_format(), **kwargs)
    assert str(info.registered_model_version) == "1"
    local = mlflow.artifacts.download_artifacts(f"models:/{name}/1")
    with open(os.path.join(local, "requirements.txt")) as f:
        return f.read().split()


def assert_same_records(child: picklehooks.Log, parent: picklehooks.Log) -> None:
    assert [r.key for r in child.records] == [r.key for r in parent.records]
    kinds = {r.kind for r in parent.records}
    assert kinds == {"input", "output", "grad_input", "grad_output", "param", "param_grad"}
    for c, p in zip(child.records, parent.records):
        assert c.shape == p.shape and c.dtype == p.dtype, c.key
        assert {s: c.stats[s] for s in STAT_NAMES} == pytest.approx(
            {s: p.stats[s] for s in STAT_NAMES}, rel=1e-5, abs=1e-6), c.key


def test_registered_model_records_in_fresh_process(experiment, tmp_path):
    """log_model + registry + models:/NAME/1 in a fresh process: the hooks fire, same records;
    MLflow's inferred requirements name picklehooks, with no argument about it."""
    model, parent = instrumented_and_recorded()
    requirements = register(model, experiment, "picklehooks-inferred")
    assert f"picklehooks=={picklehooks.__version__}" in requirements

    out = run_fresh(CHILD, "models:/picklehooks-inferred/1", str(tmp_path / "log"), cwd=tmp_path)
    assert out.strip() == picklehooks.__file__  # the installed picklehooks
    assert_same_records(picklehooks.Log.load(tmp_path / "log"), parent)


def test_code_paths_ship_picklehooks_to_host_without_it(experiment, tmp_path):
    """code_paths=[picklehooks' directory] + explicit pip_requirements: a host where picklehooks is
    not installed loads models:/NAME/1 with the shipped copy, and records the same."""
    model, parent = instrumented_and_recorded()
    requirements = register(
        model, experiment, "picklehooks-shipped",
        code_paths=[os.path.dirname(picklehooks.__file__)],
        pip_requirements=[*mlflow.pytorch.get_default_pip_requirements(), "zstandard>=0.22"])
    assert not [r for r in requirements if r.startswith("picklehooks")]

    out = run_fresh(ONLY_SHIPPED_PICKLEHOOKS + CHILD, "models:/picklehooks-shipped/1", str(tmp_path / "log"),
                    cwd=tmp_path)
    assert out.strip().endswith(os.path.join("code", "picklehooks", "__init__.py"))
    assert out.strip() != picklehooks.__file__
    assert_same_records(picklehooks.Log.load(tmp_path / "log"), parent)


# -- per-layer statistics as run metrics ----------------------------------------------------------

# Two training steps of a small MLP: step 0 runs one batch, step 1 two (so each module is
# called twice in step 1, and its second call's metrics get /call1).
STEPS = [[1], [2, 3]]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(seed: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed))


def plain_values() -> dict[str, list[tuple[int, dict]]]:
    """``{metric key: [(step, float64 statistics), ...]}`` from plain forward and backward hooks on an
    un-instrumented copy, with the key the docs promise: ``/call<k>`` for the k-th call in a step."""
    model = mlp()
    seen: list[tuple[str, str, int, torch.Tensor]] = []
    step = [0]
    for name, module in model.named_children():
        module.register_forward_hook(lambda m, i, o, name=name: seen.append((name, "output", step[0], o.detach())))
        module.register_full_backward_hook(
            lambda m, gi, go, name=name: seen.append((name, "grad_output", step[0], go[0].detach())))
    with warnings.catch_warnings():  # module 0's input needs no grad: its hook sees grad_output only
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        for step[0], seeds in enumerate(STEPS):
            for seed in seeds:
                model(batch(seed)).sum().backward()
    out: dict[str, list[tuple[int, dict]]] = {}
    calls: dict[tuple, int] = {}
    for name, kind, at, tensor in seen:
        k = calls[name, kind, at] = calls.get((name, kind, at), -1) + 1
        prefix = f"picklehooks/{name}/{kind}" + (f"/call{k}" if k else "")
        for stat, value in plain_stats(tensor).items():
            out.setdefault(f"{prefix}/{stat}", []).append((at, value))
    return out


def recorded() -> picklehooks.Log:
    model = mlp()
    with picklehooks.instrument(model, capture=("output", "grad_output")), picklehooks.record() as log:
        for seeds in STEPS:
            for seed in seeds:
                model(batch(seed)).sum().backward()
            log.next_step()
    return log


def history(run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(run_id, key))


def logged_keys(run_id: str) -> set[str]:
    return set(mlflow.MlflowClient().get_run(run_id).data.metrics)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7) or (math.isnan(a) and math.isnan(b))


class TestLogMetrics:
    def test_values_match_plain_pytorch_at_their_steps(self, experiment):
        """Every statistic read back from the SQLite store is plain PyTorch's float64 value, at the record's step."""
        log, want = recorded(), plain_values()
        with mlflow.start_run(experiment_id=experiment) as run:
            written = phm.log_metrics(log)
        default = {f"{p.rsplit('/', 1)[0]}/{s}" for p in want for s in phm.STATS}
        assert logged_keys(run.info.run_id) == default
        stored = sum(len(history(run.info.run_id, key)) for key in default)
        assert written == stored == len(phm.STATS) * len(log.records)
        for key in default:
            got, expected = history(run.info.run_id, key), want[key]
            assert [s for s, _ in got] == [s for s, _ in expected], key
            assert all(close(g, e) for (_, g), (_, e) in zip(got, expected)), (key, got, expected)
        assert [s for s, _ in history(run.info.run_id, "picklehooks/0/output/mean")] == [0, 1]
        assert [s for s, _ in history(run.info.run_id, "picklehooks/0/output/call1/mean")] == [1]

    def test_same_values_as_the_log(self, experiment):
        """Each logged value is the record's own statistic (rec.stats), as a float."""
        log = recorded()
        with mlflow.start_run(experiment_id=experiment) as run:
            phm.log_metrics(log, stats=STAT_NAMES)
        for (key, value, at) in phm.metrics(log, stats=STAT_NAMES):
            assert any(s == at and close(v, value) for s, v in history(run.info.run_id, key)), key
        for rec in log.records:
            call = [r for r in log.records if (r.module, r.kind, r.step) == (rec.module, rec.kind, rec.step)]
            k = call.index(rec)
            prefix = f"picklehooks/{rec.module}/{rec.kind}" + (f"/call{k}" if k else "")
            for stat in STAT_NAMES:
                assert (rec.step, float(rec.stats[stat])) in history(run.info.run_id, f"{prefix}/{stat}"), prefix

    def test_log_to_mlflow(self, experiment):
        """log.to_mlflow(...) is log_metrics(log, ...)."""
        if not hasattr(picklehooks.Log, "to_mlflow"):
            pytest.skip("Log.to_mlflow is not there yet")
        log = recorded()
        with mlflow.start_run(experiment_id=experiment) as run:
            assert log.to_mlflow(step=3, stats=("norm",)) == len(log.records)
        keys = logged_keys(run.info.run_id)
        assert keys == {key for key, _, _ in phm.metrics(log, step=3, stats=("norm",))}
        assert {s for key in keys for s, _ in history(run.info.run_id, key)} == {3}

    def test_step_stats_and_run_id(self, experiment):
        """step= puts every record at one step; stats= picks the statistics; run_id= logs outside an active run."""
        log = recorded()
        run_id = mlflow.MlflowClient().create_run(experiment).info.run_id
        assert mlflow.active_run() is None
        written = phm.log_metrics(log, step=7, run_id=run_id, stats=("max", "n_nan"))
        assert written == 2 * len(log.records)
        keys = logged_keys(run_id)
        assert {k.rsplit("/", 1)[1] for k in keys} == {"max", "n_nan"}
        assert {s for k in keys for s, _ in history(run_id, k)} == {7}
        # step 0's one call and step 1's two calls all land at step 7: calls 0, 1 and 2
        assert "picklehooks/2/grad_output/call2/max" in keys

    def test_batches_of_at_most_1000(self, experiment):
        """1050 metrics go out in log_batch calls of at most 1000, and all of them arrive."""
        model = nn.Sequential(*[nn.Identity() for _ in range(150)])
        with picklehooks.instrument(model, capture="output"), picklehooks.record() as log:
            model(batch(1))

        class Spy:
            def __init__(self):
                self.client, self.sizes = mlflow.MlflowClient(), []

            def log_batch(self, run_id, metrics):
                self.sizes.append(len(metrics))
                self.client.log_batch(run_id, metrics=metrics)

        spy = Spy()
        with mlflow.start_run(experiment_id=experiment) as run:
            assert phm.log_metrics(log, client=spy) == 1050
        assert spy.sizes == [1000, 50]
        assert len(logged_keys(run.info.run_id)) == 1050

    def test_nan_and_inf(self, experiment):
        """NaN statistics read back NaN, infinite ones as float64's largest value (SQL stores); counts exact."""
        class Plant(nn.Module):
            def forward(self, x):
                with_nan, with_inf = x.clone(), x.clone()
                with_nan[0, 0] = math.nan
                with_inf[1, 1], with_inf[2, 2] = math.inf, -math.inf
                return with_nan, with_inf

        model = nn.Sequential(Plant())
        with picklehooks.instrument(model, capture="output"), picklehooks.record() as log:
            model(batch(4))
        nan, inf = (r.stats for r in log.records)
        assert math.isnan(nan["mean"]) and math.isinf(inf["absmax"]) and math.isnan(inf["mean"])
        with mlflow.start_run(experiment_id=experiment) as run:
            phm.log_metrics(log, stats=STAT_NAMES)
        value = {tuple(k.split("/")[-2:]): history(run.info.run_id, k)[0][1] for k in logged_keys(run.info.run_id)}
        assert all(math.isnan(value["0", s]) for s in ("mean", "std", "min", "max", "absmax", "norm"))
        assert (value["0", "n_nan"], value["0", "n_inf"]) == (1.0, 0.0)
        assert value["1", "absmax"] == value["1", "max"] == value["1", "norm"] == sys.float_info.max
        assert value["1", "min"] == -sys.float_info.max
        assert math.isnan(value["1", "mean"])  # inf - inf
        assert (value["1", "n_nan"], value["1", "n_inf"]) == (0.0, 2.0)

    def test_keys_mlflow_refuses_are_sanitised(self, experiment):
        """(root), ':' and '(' become '_'; '.'/'' path segments become underscores; MLflow accepts every key."""
        rows = [
            {"module": m, "kind": "output", "path": p, "call": 0, "step": 0, "shape": [2], "dtype": "float32",
             "value": None, **dict.fromkeys(STAT_NAMES, 1.0)}
            for m, p in [("", ""), ("blocks.0", "a:b"), ("dict(x)", "0/1"), ("enc dec", "."), ("é", "..")]]
        log = picklehooks.Log.from_rows(rows)
        keys = [k for k, _, _ in phm.metrics(log, stats=("mean",))]
        assert keys == ["picklehooks/_root_/output/mean", "picklehooks/blocks.0/output/a_b/mean",
                        "picklehooks/dict_x_/output/0/1/mean", "picklehooks/enc dec/output/_/mean",
                        "picklehooks/_/output/__/mean"]
        with mlflow.start_run(experiment_id=experiment) as run:
            assert phm.log_metrics(log, stats=("mean",)) == 5
        assert logged_keys(run.info.run_id) == set(keys)

    def test_keys_that_would_merge_raise(self):
        """Two modules whose names differ only in refused characters would share a key: refused, naming both."""
        rows = [{"module": m, "kind": "output", "path": "", "call": 0, "step": 0, "shape": [2], "dtype": "float32",
                 "value": None, **dict.fromkeys(STAT_NAMES, 1.0)} for m in ("a:b", "a_b")]
        with pytest.raises(PicklehooksError, match=r"'picklehooks/a:b/output' and 'picklehooks/a_b/output'"):
            phm.metrics(picklehooks.Log.from_rows(rows))
        long = [{**rows[0], "module": "m" * 250}]
        with pytest.raises(PicklehooksError, match="MLflow allows 250"):
            phm.metrics(picklehooks.Log.from_rows(long))

    def test_errors(self, experiment, monkeypatch):
        """No active run and no run_id, unknown stats, a bad step, and no mlflow installed: clear errors."""
        log = recorded()
        assert mlflow.active_run() is None
        with pytest.raises(PicklehooksError, match=r"no active MLflow run.*mlflow.start_run\(\).*run_id="):
            phm.log_metrics(log)
        with pytest.raises(PicklehooksError, match=r"stats=\('mean', 'median'\): choose among mean, std"):
            phm.log_metrics(log, run_id="x", stats=("mean", "median"))
        with pytest.raises(PicklehooksError, match=r"step=1.5: use an int"):
            phm.log_metrics(log, step=1.5)
        monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` finds where it isn't installed
        with pytest.raises(PicklehooksError, match=r"needs the mlflow package: pip install 'picklehooks\[mlflow\]'"):
            phm.log_metrics(log, run_id="x")
        with pytest.raises(PicklehooksError, match="needs the mlflow package"):
            phm.pip_requirements()


# -- MLflow's default format, "pt2" (torch.export) ---------------------------------------------------

# The loading process imports picklehooks first: the exported program calls picklehooks:: ops,
# registered at import. It also runs a batch of another size (the batch dimension is dynamic).
CHILD_PT2 = """
import sys, torch
import picklehooks
import mlflow.pytorch
model = mlflow.pytorch.load_model(sys.argv[1])
x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
with picklehooks.record() as log:
    torch.nn.functional.cross_entropy(model(x), torch.arange(6) % 3).backward()
log.save(sys.argv[2])
print(type(model).__module__, tuple(model(torch.randn(9, 4)).shape))
"""


def default_format() -> str:
    params = inspect.signature(mlflow.pytorch.log_model).parameters
    if "serialization_format" not in params:
        pytest.skip("this MLflow has no serialization_format (no pt2)")
    return mlflow.pytorch._get_default_serialization_format(False)


@pytest.fixture(scope="module")
def pt2_registered(experiment):
    """An instrumented model logged in MLflow's default format (pt2) as models:/picklehooks-pt2/1, and its eager log."""
    assert default_format() == "pt2"
    model, parent = instrumented_and_recorded()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with mlflow.start_run(experiment_id=experiment):
        info = mlflow.pytorch.log_model(model, name="model", registered_model_name="picklehooks-pt2", input_example=x,
                                        signature=phm.signature(x), pip_requirements=phm.pip_requirements())
    assert str(info.registered_model_version) == "1"
    return "models:/picklehooks-pt2/1", parent


class TestPt2:
    def test_records_in_fresh_process(self, pt2_registered, tmp_path, monkeypatch):
        """pt2 (the default): a fresh process that imports picklehooks, loads models:/NAME/1 and records gets the
        eager model's records and statistics, forward and backward, with MLflow's pickle-free check on."""
        uri, parent = pt2_registered
        local = mlflow.artifacts.download_artifacts(uri)
        assert os.listdir(os.path.join(local, "data")) == ["model.pt2"]
        with open(os.path.join(local, "requirements.txt")) as f:
            assert f"picklehooks=={picklehooks.__version__}" in f.read().split()
        # Refuse any pickle: MLflow then verifies the archive holds only tensors and JSON before loading it.
        monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")
        out = run_fresh(CHILD_PT2, uri, str(tmp_path / "log"), cwd=tmp_path)
        assert out.split() == ["torch.fx.graph_module", "(9,", "3)"]
        assert_same_records(picklehooks.Log.load(tmp_path / "log"), parent)

    def test_loading_before_importing_picklehooks_fails(self, pt2_registered, tmp_path):
        """Without `import picklehooks` first, torch.export.load can't resolve the picklehooks:: ops."""
        uri, _ = pt2_registered
        with pytest.raises(AssertionError, match=r"failed to resolve torch\.ops\.picklehooks\.\w+\.default"):
            run_fresh("import sys, mlflow.pytorch; mlflow.pytorch.load_model(sys.argv[1])", uri, cwd=tmp_path)

    def test_requirement_inference_cannot_load_it(self, experiment):
        """Why pip_requirements() is passed: MLflow's inference loads the model in a process that never
        imports picklehooks (it raises here, as MLFLOW_REQUIREMENTS_INFERENCE_RAISE_ERRORS is set)."""
        model, _ = instrumented_and_recorded()
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
        with mlflow.start_run(experiment_id=experiment), pytest.raises(
                mlflow.exceptions.MlflowException, match=r"failed to resolve torch\.ops\.picklehooks"):
            mlflow.pytorch.log_model(model, name="model", input_example=x, signature=phm.signature(x))


class TestHelpers:
    def test_signature(self):
        """TensorSpec inputs with a variable first dimension; several inputs are named; no NumPy dtype raises."""
        np = pytest.importorskip("numpy")
        sig = phm.signature(torch.zeros(6, 4))
        (spec,) = sig.inputs.inputs
        assert (spec.type, spec.shape, spec.name) == (np.dtype("float32"), (-1, 4), None)
        assert sig.outputs is None
        specs = phm.signature(np.zeros((2, 3, 5), dtype=np.int64), torch.zeros(2, dtype=torch.float64)).inputs.inputs
        assert [(s.type, s.shape, s.name) for s in specs] == [
            (np.dtype("int64"), (-1, 3, 5), "input0"), (np.dtype("float64"), (-1,), "input1")]
        with pytest.raises(PicklehooksError, match="dtype torch.bfloat16 has no NumPy dtype"):
            phm.signature(torch.zeros(2, dtype=torch.bfloat16))
        with pytest.raises(PicklehooksError, match=r"takes the model's example inputs.*\['list'\]"):
            phm.signature([1, 2])

    def test_pip_requirements(self):
        """MLflow's PyTorch defaults, picklehooks pinned to this version, then any extra."""
        reqs = phm.pip_requirements("zstandard>=0.22")
        assert reqs == [*mlflow.pytorch.get_default_pip_requirements(), f"picklehooks=={picklehooks.__version__}",
                        "zstandard>=0.22"]
