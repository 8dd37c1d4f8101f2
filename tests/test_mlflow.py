"""MLflow: an instrumented model logged with ``mlflow.pytorch.log_model`` and registered in a local
registry (SQLite tracking store, local artifact store, no server) records, after
``mlflow.pytorch.load_model("models:/NAME/1")`` in a fresh process, what it recorded before logging.

Two ways the loading host finds picklehooks: installed there (MLflow's inferred
``requirements.txt`` names it), or shipped inside the model with ``code_paths``.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch import nn

mlflow = pytest.importorskip("mlflow")
import mlflow.pytorch  # noqa: E402

import picklehooks  # noqa: E402
from picklehooks.log import STAT_NAMES  # noqa: E402

from .testutils import run_fresh  # noqa: E402

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
