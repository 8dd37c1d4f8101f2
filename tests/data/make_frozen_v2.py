"""Regenerate the v2 wire-contract artifacts in tests/data (issue #27) from the code as it is.

Writes into the directory given (default: tests/data/frozen_v2, a folder of its own, so that the
``frozen_v*.pt`` files tests/contract/test_frozen.py loads stay only its checkpoints), each file
under 200 KB:

* ``save.pt``: an instrumented model, ``torch.save``d: its hooks are
  ``picklehooks._hub.<name>`` globals whose generated text calls ``picklehooks._hookrt``;
* ``package.pt``: the same model with a user hook made by ``picklehooks.portable``,
  in a torch.package archive (``picklehooks.package.save``), which carries the shim, the stub
  hub and a copy of the runtime that defers to the host's ``_ops``, ``_state`` and ``_shards``;
* ``script.pt``: ``torch.jit.save`` of the model instrumented with ``scriptable=True``
  and scripted: its code calls ``torch.ops.picklehooks.*`` by schema;
* ``export.pt2``: ``torch.export.save`` of the exported model: its graph calls the ops too;
* ``expected.pt`` (loads with ``weights_only=True``): for each artifact, the input, every
  record of one forward and backward step as the artifact, loaded in a fresh process, recorded it
  then (key, step, shape, dtype, statistics, in order), and plain PyTorch's values for the same
  step on an un-instrumented copy of the model (with the same user hook, as a plain function);
* ``wire_contract.json``: the op schemas, the entry points generated hook text and archived
  runtime copies call, the ``Log`` members those copies use, the module paths, attributes and
  flag bits saved files carry. Everything in it is read off the code being frozen and off the
  artifacts just written, never typed in by hand (docs/contract.md explains it).

tests/contract/test_wire_contract.py loads each artifact in a fresh process with the code of the day and
checks it against these files. Run this once per frozen version, from a worktree of the commit
being frozen (so that nothing uncommitted leaks in), never to "fix" a failing test: the point of a
frozen file is that what an earlier picklehooks saved keeps loading and recording the same::

    git worktree add --detach /tmp/freeze HEAD
    cd /tmp/freeze && PYTHONPATH=/tmp/freeze python /path/to/tests/data/make_frozen_v2.py /path/to/tests/data/frozen_v2
    git worktree remove --force /tmp/freeze
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import math
import os
import pickletools
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# The editable install's finder (which a .pth file appends to sys.meta_path) fills in, from the
# installed checkout, whatever the checkout on sys.path lacks: its C extensions. Dropped, so that
# every picklehooks module comes from the checkout being frozen (its Python fallbacks record the
# same values). The children below drop it too (CHILD).
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]

import torch  # noqa: E402
from torch import nn  # noqa: E402

import picklehooks  # noqa: E402
import picklehooks.serialize.package  # noqa: E402 - picklehooks.package when frozen

ROOT = Path(picklehooks.__file__).resolve().parent  # the package being frozen
SEED = 2027
#: Everything but buffers (the model has none).
CAPTURE = ("input", "output", "grad_input", "grad_output", "param", "param_grad")
ARTIFACTS = {"save": "save.pt", "package": "package.pt", "script": "script.pt", "export": "export.pt2"}
# The step the expected records come from, shared with the test that runs it again.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.contract.frozen_step import LOADERS, STEP  # noqa: E402

#: A fresh process that loads one artifact and records one step, with the code being frozen
#: (the editable install's finder dropped, as above).
CHILD = ("import sys\nsys.meta_path[:] = [f for f in sys.meta_path "
         "if not getattr(f, '__module__', '').startswith('__editable__')]\n" + STEP)


def make_model() -> nn.Sequential:
    """Linear, LayerNorm and ReLU, a nested Sequential, and one ReLU called twice (calls 0 and 1)."""
    torch.manual_seed(SEED)
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), relu,
                          nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), relu, nn.Linear(8, 3))
    with torch.no_grad():  # LayerNorm starts at ones and zeros: statistics worth comparing instead
        for norm in (model[1], model[3][1]):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.2, 0.2)
    return model


def make_scale(factor):
    """The user hook the archive carries (portable), and the plain copy (as it is)."""
    def scale_output(module, inputs, output):
        return output * factor

    return scale_output


def plain_step(model: nn.Module, x: torch.Tensor) -> dict:
    """One step of the un-instrumented ``model`` under plain PyTorch hooks: each value picklehooks
    records, keyed ``"module|kind|path|call"``, and the output and gradients.

    Each tensor here has one consumer, so its own gradient is the one flowing through that use.
    The hooks go first (``prepend``): picklehooks' hooks run before a hook the user added later.
    """
    values, calls, handles = {}, {}, []

    def keep(key: tuple, t: torch.Tensor) -> None:
        values["|".join(map(str, key))] = t.detach().clone()

    def on_grad(key: tuple):
        return lambda g: keep(key, g)

    modules = [(n, m) for n, m in model.named_modules() if n]
    for name, module in modules:
        def pre(mod, inputs, name=name):
            call = calls[name] = calls.get(name, -1) + 1
            for pname, p in mod.named_parameters(recurse=False):
                keep((name, "param", pname, call), p)
            for i, v in enumerate(inputs):
                keep((name, "input", str(i), call), v)
                v.register_hook(on_grad((name, "grad_input", str(i), call)))

        def post(mod, inputs, output, name=name):
            keep((name, "output", "", calls[name]), output)
            output.register_hook(on_grad((name, "grad_output", "", calls[name])))

        handles += [module.register_forward_pre_hook(pre, prepend=True),
                    module.register_forward_hook(post, prepend=True)]
    x = x.clone().requires_grad_()
    output = model(x)
    output.square().sum().backward()
    for h in handles:
        h.remove()
    for name, module in modules:
        for pname, p in module.named_parameters(recurse=False):
            keep((name, "param_grad", pname, 0), p.grad)
    return {"output": output.detach(), "input_grad": x.grad,
            "param_grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "values": values}


def build(which: str, path: Path, x: torch.Tensor) -> dict:
    """Write artifact ``which`` to ``path``; return plain PyTorch's step on an un-instrumented copy."""
    model = make_model()
    plain = copy.deepcopy(model)
    picklehooks.instrument(model, capture=CAPTURE, example_inputs=(x,), scriptable=which == "script")
    if which == "save":
        torch.save(model, path)
    elif which == "package":
        model[5].register_forward_hook(picklehooks.portable(make_scale(-0.5)))
        plain[5].register_forward_hook(make_scale(-0.5))
        picklehooks.serialize.package.save(path, model)
    elif which == "script":
        torch.jit.save(torch.jit.script(model), path)
    else:
        torch.export.save(torch.export.export(model, (x.clone().requires_grad_(),)), path)
    return plain_step(plain, x)


def record_fresh(which: str, path: Path, x_path: Path, out: Path) -> dict:
    """Load the artifact in a fresh process with the code being frozen, record one step; its results."""
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent))
    proc = subprocess.run([sys.executable, "-c", CHILD.format(load=LOADERS[which]), str(path), str(x_path), str(out)],
                          capture_output=True, text=True, cwd=ROOT.parent, env=env, timeout=600)
    if proc.returncode:
        raise SystemExit(f"recording {path.name} failed:\n{proc.stderr}")
    got = torch.load(out, weights_only=True)
    assert Path(got.pop("picklehooks")).resolve().parent == ROOT, "the child used another picklehooks"
    return got


def plain_stats(t: torch.Tensor) -> dict:
    """The statistics by their definition (as tests/testutils.plain_stats): float64, population std."""
    v = t.double()
    return {"mean": v.mean().item(), "std": v.std(correction=0).item(), "min": v.min().item(),
            "max": v.max().item(), "absmax": v.abs().max().item(), "norm": torch.linalg.vector_norm(v).item(),
            "nan": int(v.isnan().sum()), "inf": int(v.isinf().sum()), "zero_frac": (v == 0).sum().item() / v.numel()}


def check_against_plain(which: str, got: dict, plain: dict) -> None:
    """Refuse to freeze records that plain PyTorch disagrees with."""
    keys = {"|".join(map(str, r["key"])) for r in got["records"]}
    assert keys == set(plain["values"]), (which, sorted(keys ^ set(plain["values"])))
    for r in got["records"]:
        want = plain["values"]["|".join(map(str, r["key"]))]
        assert list(r["shape"]) == list(want.shape) and r["dtype"] == str(want.dtype).removeprefix("torch.")
        for name, value in plain_stats(want).items():
            assert math.isclose(r["stats"][name], value, rel_tol=1e-5, abs_tol=1e-6), (which, r["key"], name)
    torch.testing.assert_close(got["output"], plain["output"])
    torch.testing.assert_close(got["input_grad"], plain["input_grad"])
    torch.testing.assert_close(got["param_grads"], plain["param_grads"])


# -- the contract surfaces, read off the code and the artifacts -----------------------------------

def pickle_globals(data: bytes) -> set[tuple[str, str]]:
    """(module, name) of every global a pickle names."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        if isinstance(arg, str):
            strings.append(arg)
    return found


def pickle_strings(data: bytes) -> set[str]:
    return {arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)}


def zip_member(path: Path, suffix: str) -> bytes:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith(suffix)]
        return z.read(name)


def graph_ops(path: Path, suffix: str) -> list[str]:
    """The ``picklehooks::`` ops a scripted module's code or an exported program's graph calls."""
    with zipfile.ZipFile(path) as z:
        text = "\n".join(z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith(suffix))
    return sorted(set(re.findall(r"\bops\.picklehooks\.(\w+)", text)))


def package_sources(path: Path) -> dict[str, str]:
    """Module name -> source of every module of ours the archive carries."""
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1][:-3].replace("/", "."): z.read(n).decode()
                for n in z.namelist() if re.fullmatch(r"[^/]+/picklehooks/.*\.py", n)}


def attribute_reads(source: str, owner: str) -> set[str]:
    """Attributes read off the name ``owner`` in ``source`` (``owner.x``), and the string keys
    of ``owner.__dict__.get("k")``/``setdefault("k", ...)`` as ``__dict__['k']``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == owner:
            if node.attr != "__dict__":
                found.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "__dict__"
              and isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == owner
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(f"__dict__[{node.args[0].value!r}]")
    return found


def host_imports(source: str) -> set[str]:
    """Absolute ``importlib.import_module("picklehooks....")`` calls: the host modules a copy defers to."""
    return {node.args[0].value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("picklehooks.")}


def describe(obj) -> dict:
    """What a caller relies on: a function's parameters (name, kind, has a default), a class, or a value's type."""
    if inspect.isclass(obj):
        return {"kind": "class"}
    if callable(obj):
        params = inspect.signature(obj).parameters.values()
        return {"kind": "function",
                "params": [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in params]}
    return {"kind": "value", "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}


def contract(data: Path, expected: dict) -> dict:
    import importlib

    from picklehooks import _ops, _shim

    # Generated hook text: the modules of the frozen package that write it (they import the runtime
    # as _rt), and the texts the artifacts carry, decoded.
    writers = {p.relative_to(ROOT.parent).as_posix(): p.read_text() for p in sorted(ROOT.rglob("*.py"))
               if "import picklehooks._hookrt as _rt" in p.read_text()}
    save_pickle = zip_member(data / ARTIFACTS["save"], "data.pkl")
    package_pickle = zip_member(data / ARTIFACTS["package"], "model/model.pkl")
    hub_names = sorted(name for module, name in pickle_globals(save_pickle) if module == _shim.HUB_NAME)
    texts = [picklehooks.codec.decode(n) for n in hub_names]
    rt_calls = set()
    for text in [*writers.values(), *texts]:
        rt_calls |= set(re.findall(r"\b_rt\.(\w+)", text))
    text_ops = set()
    for text in [*writers.values(), *texts]:
        text_ops |= set(re.findall(r"\btorch\.ops\.picklehooks\.(\w+)", text))
    # Kept for hooks generated by earlier versions, which saved files hold (see _hookrt.skip).
    legacy_rt = {"skip"}

    # The runtime a torch.package archive carries: what its copies look up on the host's modules,
    # and what they call on the host's log.
    sources = package_sources(data / ARTIFACTS["package"])
    deferred = {}
    for name, source in sorted(sources.items()):
        for host in sorted(host_imports(source)):
            deferred.setdefault(host, set()).update(attribute_reads(source, "_host"))
    log_members = set()
    for source in sources.values():
        log_members |= attribute_reads(source, "log")

    entry_points = {}
    for module_name, names in [("picklehooks._hookrt", rt_calls | legacy_rt), *sorted(deferred.items())]:
        module = importlib.import_module(module_name)
        entry_points[module_name] = {n: describe(getattr(module, n)) for n in sorted(names)}
    log = picklehooks.Log()
    members = {}
    for name in sorted(log_members):
        if name.startswith("__dict__["):
            members[name] = {"kind": "instance __dict__ key", "set_by": "the runtime (setdefault)"}
        elif callable(getattr(picklehooks.Log, name, None)):
            members[name] = describe(getattr(picklehooks.Log, name))
        else:
            members[name] = describe(getattr(log, name))

    schemas = {s.name + (f".{s.overload_name}" if s.overload_name else ""): str(s)
               for s in torch._C._jit_get_all_schemas() if s.name.startswith("picklehooks::")}
    flag_names = ("VALUE", "GRAD", "STATS", "TENSOR", "PARAM_GRAD", "GUARD", "COUNTED", "GRAD_SURE", "GRAD_NONE",
                  "INPUT_GRAD", "_SITE_SHIFT")
    strings = pickle_strings(save_pickle)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {
        "about": "The wire contract frozen by tests/data/make_frozen_v2.py; see docs/contract.md. "
                 "Checked by tests/contract/test_wire_contract.py. Regenerate only for a new frozen version.",
        "frozen_from": {"commit": head, "picklehooks": picklehooks.__version__, "torch": torch.__version__},
        "artifacts": {which: name for which, name in ARTIFACTS.items()},
        "op_schemas": dict(sorted(schemas.items())),
        "ops_called": {
            "generated hook text (TorchScript bodies)": sorted(text_ops),
            ARTIFACTS["script"]: graph_ops(data / ARTIFACTS["script"], ".py"),
            ARTIFACTS["export"]: graph_ops(data / ARTIFACTS["export"], ".json"),
            f"the runtime copies in {ARTIFACTS['package']}": sorted(
                {op for source in sources.values() for pair in re.findall(
                    r"\btorch\.ops\.picklehooks\.(\w+)|getattr\(torch\.ops\.picklehooks, \"(\w+)\"", source)
                 for op in pair if op}),
        },
        "hub": {
            "module": _shim.HUB_NAME,
            "shim": _shim.SHIM_NAME,
            "format_letters": sorted(_shim.FORMATS),
            "current_format": _shim.CURRENT_FORMAT,
            "letters_in_artifacts": sorted({n[0] for n in hub_names}),
        },
        "pickle_globals": {
            ARTIFACTS[which]: sorted(f"{m}.{n}" for m, n in pickle_globals(data) if m.startswith("picklehooks"))
            for which, data in (("save", save_pickle), ("package", package_pickle))
        },
        "package_modules": sorted(sources),
        # The stub hub an archive carries imports the archive's copy of the shim by this name.
        "archive_hub_stub_imports": sorted(f"{n.module}.{a.name}" for n in ast.walk(ast.parse(sources[_shim.HUB_NAME]))
                                           if isinstance(n, ast.ImportFrom) for a in n.names),
        "host_modules_archives_defer_to": sorted(deferred),
        "hook_text_writers": sorted(writers),
        "hook_text_imports": sorted({m for t in texts for m in re.findall(r"^import (\S+)", t, re.M)
                                     if m.startswith("picklehooks")}),
        "entry_points": entry_points,
        "entry_points_legacy": {"picklehooks._hookrt": sorted(legacy_rt)},
        "log_members": members,
        "flags": {name: getattr(_ops, name) for name in flag_names},
        "saved_attributes": sorted(s for s in strings if s in ("_picklehooks_name", "_picklehooks_owners")),
        "stat_names": expected["stat_names"],
    }


def main(out_dir: str) -> None:
    data = Path(out_dir).resolve()
    data.mkdir(exist_ok=True)
    bad = [m.__file__ for name, m in list(sys.modules.items())
           if name.split(".")[0] == "picklehooks" and getattr(m, "__file__", None)
           and ROOT not in Path(m.__file__).resolve().parents]
    assert not bad, f"modules from outside {ROOT}: {bad}"
    print(f"freezing {ROOT} (picklehooks {picklehooks.__version__}, torch {torch.__version__})")
    torch.manual_seed(SEED + 1)
    x = torch.randn(4, 6)
    expected = {"about": "Expected records and plain-PyTorch ground truth for the artifacts beside this file; "
                         "written by tests/data/make_frozen_v2.py.",
                "loss": "model(x).square().sum()", "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        x_path = Path(tmp) / "x.pt"
        torch.save(x, x_path)
        for which, name in ARTIFACTS.items():
            path = data / name
            plain = build(which, path, x)
            got = record_fresh(which, path, x_path, Path(tmp) / f"{which}.pt")
            check_against_plain(which, got, plain)
            expected["cases"][which] = {"artifact": name, "input": x, "records": got["records"], "plain": plain}
            print(f"{name}: {path.stat().st_size} bytes, {len(got['records'])} records")
    expected["stat_names"] = list(expected["cases"]["save"]["records"][0]["stats"])
    torch.save(expected, data / "expected.pt")
    with open(data / "wire_contract.json", "w") as f:
        json.dump(contract(data, expected), f, indent=1)
        f.write("\n")
    for name in ("expected.pt", "wire_contract.json"):
        print(f"{name}: {(data / name).stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "frozen_v2"))
