"""Write the v3 wire-contract artifacts into tests/data/frozen_v3 from the code as it is.

Version 3 adds to tests/data/frozen_v2 what programs traced, exported or scripted since issue #39
record: a ``picklehooks::call_site(module, site, cls)`` op per module call in traced and exported
graphs, whose arguments are the call's source, and the ``Log`` members the kernels call
(``_call_site``; ``_script_site``, by which a scripted program's records get the sites its graphs
keep). Written, each under 50 KB:

* ``trace.pt``: ``torch.jit.save`` of ``torch.jit.trace`` of ``tests.models.small.ThreePlaces``
  (one ``Identity`` called from three lines, one in a loop; blocks in a loop), instrumented with
  ``modules=["", "*"]`` and ``capture=("output", "grad_output")``;
* ``export.pt2``: ``torch.export.save`` of the same model exported;
* ``script.pt``: ``torch.jit.save`` of the model instrumented with ``scriptable=True`` and scripted;
* ``<artifact>.input.pt``: the input of the step;
* ``expected.json``: per artifact, ``[module, kind, path, call, source]`` of every record of one step
  (``tests.contract.frozen_v3_step.run_step``), as the artifact recorded it in a fresh process
  running the code being frozen; and the op's schema and the member, read off that code.

tests/contract/test_frozen_v3.py loads each artifact in a fresh process with the code of the day and
checks it against these files. Run once, from a worktree of the commit being frozen, never to
"fix" a failing test::

    git worktree add --detach /tmp/freeze HEAD
    cd /tmp/freeze && PYTHONPATH=/tmp/freeze python tests/data/make_frozen_v3.py /path/to/tests/data/frozen_v3
    git worktree remove --force /tmp/freeze
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]

import torch  # noqa: E402

import picklehooks  # noqa: E402
from picklehooks.capture.log import Log  # noqa: E402
from tests.contract.frozen_v3_step import CHILD  # noqa: E402
from tests.models import small  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = small.ThreePlaces()
    picklehooks.instrument(model, modules=["", "*"], capture=("output", "grad_output"))
    (x,) = small.inputs("mlp")
    torch.jit.save(torch.jit.trace(model, (x,)), out / "trace.pt")
    torch.export.save(torch.export.export(model, (x,)), out / "export.pt2")
    torch.manual_seed(0)
    scriptable = small.ThreePlaces()
    picklehooks.instrument(scriptable, modules=["", "*"], capture=("output", "grad_output"), scriptable=True)
    torch.jit.save(torch.jit.script(scriptable), out / "script.pt")
    expected = {"op_schema": str(torch.ops.picklehooks.call_site.default._schema),
                "log_members": [f"{name}{inspect.signature(getattr(Log, name))}" for name in ("_call_site", "_script_site")],
                "records": {}}
    for which, name in (("trace", "trace.pt"), ("export", "export.pt2"), ("script", "script.pt")):
        torch.save(x, out / f"{name}.input.pt")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, "-c", CHILD, which, str(out / name), str(REPO)],
                              capture_output=True, text=True, env=env, cwd=REPO, check=True)
        expected["records"][which] = json.loads(done.stdout.strip().splitlines()[-1])
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "tests" / "data" / "frozen_v3")
