"""Register an instrumented model in an MLflow model registry and record with it in a fresh process.

Shows:

1. ``picklehooks.instrument(model)`` and ``picklehooks.record()`` in this process.
2. ``log.to_mlflow()`` (``picklehooks.integrations.mlflow.log_metrics(log)``): every
   layer's statistics as metrics of the run, read back from the store.
3. ``mlflow.pytorch.log_model(model, registered_model_name=...)`` into a local
   registry: a SQLite tracking database and a local artifact store in a
   temporary directory, no server. The hooks are portable, so the model
   pickles as it is; ``serialization_format="pickle"`` is passed because
   recent MLflow versions default to ``"pt2"`` (``torch.export``), which
   works too but needs more arguments (see ``picklehooks.integrations.mlflow``).
4. The ``requirements.txt`` MLflow infers for the model: it lists
   ``picklehooks`` (the version installed here), because loading the model
   imports it.
5. A fresh process that knows nothing of this script runs
   ``mlflow.pytorch.load_model("models:/NAME/1")``: unpickling imports
   picklehooks, the hooks fire, and ``record()`` captures the same records
   (same names, same statistics) as this process did before logging.

Needs MLflow: ``pip install mlflow`` (or the lighter
``pip install mlflow-skinny sqlalchemy alembic``). Synthetic data, CPU,
about 20 seconds (most of it MLflow creating its database and inferring
requirements).

Run: python examples/10_mlflow_registry.py
"""

import inspect
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Quieter MLflow, here and in the child process (which inherits the environment).
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import torch
import torch.nn as nn

import picklehooks

try:
    import mlflow
    import mlflow.pytorch

    import picklehooks.integrations.mlflow
except ImportError:
    print("this example needs MLflow: pip install mlflow (or mlflow-skinny sqlalchemy alembic)")
    sys.exit(0)

NAME = "picklehooks-mlp"

CHILD = """
import sys, torch
import mlflow.pytorch
model = mlflow.pytorch.load_model(sys.argv[1])        # no picklehooks import needed to load
import picklehooks                                      # ... but record() is how you read the hooks
x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
y = torch.arange(16) % 3
with picklehooks.record() as log:
    torch.nn.functional.cross_entropy(model(x), y).backward()
print(f"  {len(log.records)} records; the first 4:")
for r in log.records[:4]:
    print(f"    {r.module:>2} {r.kind:<11} mean {r.stats['mean']:+.4f}  std {r.stats['std']:.4f}")
log.save(sys.argv[2])
"""


def pickle_format() -> dict:
    """``serialization_format="pickle"`` where this MLflow has the argument (it defaults to "pt2" there)."""
    return {"serialization_format": "pickle"} if "serialization_format" in inspect.signature(
        mlflow.pytorch.log_model).parameters else {}


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    handle = picklehooks.instrument(model)  # outputs and their gradients, every submodule
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    y = torch.arange(16) % 3
    with picklehooks.record() as log:
        nn.functional.cross_entropy(model(x), y).backward()
    print(f"this process: instrumented {', '.join(handle.modules)}; recorded {len(log.records)} records")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
        mlflow.set_tracking_uri(tracking_uri)
        experiment = mlflow.create_experiment("picklehooks", artifact_location=(tmp / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=experiment) as run:
            written = picklehooks.integrations.mlflow.log_metrics(log)  # log.to_mlflow()
            info = mlflow.pytorch.log_model(model, name="model", registered_model_name=NAME, **pickle_format())
        metrics = mlflow.MlflowClient().get_run(run.info.run_id).data.metrics
        print(f"logged {written} metrics, such as picklehooks/2/grad_output/norm = "
              f"{metrics['picklehooks/2/grad_output/norm']:.4f}")
        print(f"logged {info.model_uri} and registered it as models:/{NAME}/{info.registered_model_version}")

        local = mlflow.artifacts.download_artifacts(f"models:/{NAME}/1", dst_path=str(tmp / "download"))
        requirements = Path(local, "requirements.txt").read_text().split()
        print(f"requirements.txt MLflow inferred: {', '.join(requirements)}")

        print(f"a fresh process: mlflow.pytorch.load_model('models:/{NAME}/1'), then record():", flush=True)
        child_log = tmp / "child_log"
        subprocess.run([sys.executable, "-c", CHILD, f"models:/{NAME}/1", str(child_log)], check=True,
                       cwd=tmp, env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri})
        child = picklehooks.Log.load(child_log)

    same_keys = [r.key for r in child.records] == [r.key for r in log.records]
    same_stats = all(math.isclose(a.stats[s], b.stats[s], rel_tol=1e-5, abs_tol=1e-6)
                     for a, b in zip(log.records, child.records) for s in ("mean", "std", "absmax"))
    print(f"same records as this process before logging: keys {same_keys}, statistics {same_stats}")
    if not (same_keys and same_stats):
        sys.exit(1)


if __name__ == "__main__":
    main()
