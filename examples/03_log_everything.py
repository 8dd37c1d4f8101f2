"""Log every input, output, gradient and parameter of a model, save the log, and ship the logging with the model.

Shows:

1. ``picklehooks.instrument(model, capture="all")`` hooks every submodule;
   ``with picklehooks.record() as log:`` records one forward + backward.
2. ``log.table()``: one row per recorded value (module, kind, path, and
   statistics such as mean, std, absmax and the NaN count).
3. ``log.save(dir)`` / ``picklehooks.Log.load(dir)``: an open format
   (``records.json``, plus ``tensors.safetensors`` when tensors are kept).
4. The instrumented model saved with plain ``torch.save`` keeps its hooks: a
   fresh process that loads it and calls ``picklehooks.record()`` records too.

Synthetic data, CPU, a few seconds.

Run: python examples/03_log_everything.py
"""

import os
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn

import picklehooks

CHILD = """
import sys, torch
import picklehooks  # registers the recording ops the hooks call
model = torch.load(sys.argv[1], weights_only=False)
x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
with picklehooks.record() as log:
    torch.nn.functional.cross_entropy(model(x), y).backward()
kinds = sorted({r.kind for r in log.records})
print(f"  child process recorded {len(log.records)} records ({', '.join(kinds)})")
"""


def fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(rows: list[dict], columns: list[str]) -> None:
    cells = [[fmt(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)))


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))

    handle = picklehooks.instrument(model, capture="all")
    print(f"instrumented {len(handle.modules)} modules: {', '.join(handle.modules)}")

    with picklehooks.record() as log:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
    print(f"one forward + backward under record(): {len(log.records)} records; the first 15:")
    print_table(log.table()[:15], ["module", "kind", "path", "mean", "std", "absmax", "n_nan"])

    with tempfile.TemporaryDirectory() as tmp:
        log_dir = os.path.join(tmp, "log")
        log.save(log_dir)
        loaded = picklehooks.Log.load(log_dir)
        same = loaded.table() == log.table()
        print(f"saved to {sorted(os.listdir(log_dir))}, loaded {len(loaded.records)} records back "
              f"(identical table: {same})")

        path = os.path.join(tmp, "model.pt")
        torch.save(model, path)
        print(f"saved the instrumented model with torch.save ({os.path.getsize(path)} bytes); "
              "loading it in a fresh process:")
        subprocess.run([sys.executable, "-c", CHILD, path], check=True)


if __name__ == "__main__":
    main()
