"""The wire contract (docs/contract.md): what an earlier picklehooks saved keeps loading and recording the same.

tests/data/make_frozen_v2.py wrote tests/data/frozen_v2/ from the code before the package moved
into its layered layout (issue #27): a ``torch.save``d instrumented model, a torch.package archive
(with a portable user hook), a scripted and an exported one; the records each of them made, loaded
in a fresh process, for one forward and backward step; plain PyTorch's values for that step on an
un-instrumented copy; and ``wire_contract.json``, the names and schemas those files depend on.
Each artifact is loaded here in a fresh process, through public API only, by the code of the day.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.contract.frozen_step import LOADERS, STEP
from tests.testutils import REPO, plain_stats, run_fresh

FROZEN = REPO / "tests" / "data" / "frozen_v2"  # wherever this file moves
CONTRACT = json.loads((FROZEN / "wire_contract.json").read_text())

#: ``Record.stats`` keys renamed on the reading side since the freeze (issue #28, docs/contract.md):
#: old name -> new. Not wire: the kernels still compute the statistics in the frozen order, under
#: the frozen names (``picklehooks._stats.STAT_NAMES``); only the names records show changed.
RENAMED_STATS = {"nan": "n_nan", "inf": "n_inf"}


def _now(names) -> list[str]:
    """Frozen statistic names as records name them now: renamed, same order, none dropped or added."""
    return [RENAMED_STATS.get(name, name) for name in names]


#: Recorded in program order (the hooks run in it; graphs keep the ops in it as ordered effects).
FORWARD_KINDS = ("input", "output", "param", "buffer")
# Gradient records come in the order autograd runs its nodes, which is autograd's to choose:
# compared as a set of keys (each key names its call, so pairing with the forward is still checked).


@pytest.fixture(scope="module")
def expected() -> dict:
    """expected.pt: per artifact, its input, its frozen records and plain PyTorch's values."""
    return torch.load(FROZEN / "expected.pt", weights_only=True)


def _name(key) -> str:
    return "|".join(map(str, key))


def _forward(records: list) -> list:
    """The keys of the forward records, in the order recorded."""
    return [tuple(r["key"]) for r in records if r["key"][1] in FORWARD_KINDS]


def _gradients(records: list) -> list:
    """The keys of the gradient records, sorted."""
    return sorted(tuple(r["key"]) for r in records if r["key"][1] not in FORWARD_KINDS)


@pytest.fixture(scope="module")
def recorded(expected, tmp_path_factory):
    """``recorded(which)``: load the artifact in a fresh interpreter, run the frozen step under
    ``record()``; what came back (once per artifact)."""
    cache = {}

    def get(which: str) -> dict:
        if which not in cache:
            tmp, case = tmp_path_factory.mktemp(which), expected["cases"][which]
            torch.save(case["input"], tmp / "x.pt")
            run_fresh(STEP.format(load=LOADERS[which]), str(FROZEN / case["artifact"]), str(tmp / "x.pt"),
                      str(tmp / "got.pt"), cwd=REPO)
            cache[which] = torch.load(tmp / "got.pt", weights_only=True)
            assert Path(cache[which]["picklehooks"]).parent == REPO / "picklehooks", cache[which]["picklehooks"]
        return cache[which]

    return get


@pytest.mark.parametrize("which", list(LOADERS))
def test_frozen_artifact_records_what_it_recorded_then(which, expected, recorded):
    """Loaded in a fresh process, the artifact records what it recorded when it was frozen."""
    got, want = recorded(which)["records"], expected["cases"][which]["records"]
    assert got, ("nothing recorded: the loaded hooks found no log (an archive's runtime copy finds the host's "
                 "through picklehooks._state, and records through the Log methods in wire_contract.json)")
    assert _forward(got) == _forward(want)
    assert _gradients(got) == _gradients(want)
    frozen = {tuple(r["key"]): r for r in want}
    for r in got:
        w = frozen[tuple(r["key"])]
        assert (r["step"], tuple(r["shape"]), r["dtype"], r["value"]) == \
            (w["step"], tuple(w["shape"]), w["dtype"], w["value"]), r["key"]
        assert list(r["stats"]) == _now(expected["stat_names"]), r["key"]
        assert list(w["stats"]) == expected["stat_names"], r["key"]  # the frozen records say so too
        frozen_stats = dict(zip(_now(w["stats"]), w["stats"].values()))
        assert r["stats"] == pytest.approx(frozen_stats, rel=1e-5, abs=1e-6), r["key"]


@pytest.mark.parametrize("which", list(LOADERS))
def test_frozen_artifact_matches_plain_pytorch(which, expected, recorded):
    """The artifact's output, gradients and every record agree with an un-instrumented copy in plain PyTorch."""
    got, plain = recorded(which), expected["cases"][which]["plain"]
    torch.testing.assert_close(got["output"], plain["output"])
    torch.testing.assert_close(got["input_grad"], plain["input_grad"])
    torch.testing.assert_close(got["param_grads"], plain["param_grads"])
    assert sorted(_name(r["key"]) for r in got["records"]) == sorted(plain["values"])
    for r in got["records"]:
        value = plain["values"][_name(r["key"])]
        assert (list(r["shape"]), r["dtype"]) == (list(value.shape), str(value.dtype).removeprefix("torch.")), r["key"]
        assert r["stats"] == pytest.approx(plain_stats(value), rel=1e-5, abs=1e-6), r["key"]


# What a fresh process finds of each surface wire_contract.json froze: {surface: [problems]}.
CHECK = r"""
import importlib, inspect, json, os, sys
import torch
import picklehooks
from picklehooks import _shim

contract = json.load(open(sys.argv[1]))
problems, checked = {}, {}

def check(surface, what, why):
    checked[surface] = checked.get(surface, 0) + 1
    if why:
        problems.setdefault(surface, []).append(f"{what}: {why}")

def fits(obj, frozen):
    # Why obj can't stand where the frozen entry point stood (callers pass what they passed then), or None.
    if frozen["kind"] == "class":
        return None if inspect.isclass(obj) else f"is a {type(obj).__name__}, was a class"
    if frozen["kind"] == "value":
        now = f"{type(obj).__module__}.{type(obj).__qualname__}"
        return None if now == frozen["type"] else f"is a {now}, was a {frozen['type']}"
    if not callable(obj):
        return f"is not callable: {type(obj).__name__}"
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return None  # a C function without a signature: being callable is all one can check
    for i, (name, kind, has_default) in enumerate(frozen["params"]):
        now = params[i] if i < len(params) else None
        if now is None or (now.name, now.kind.name) != (name, kind):
            return f"parameter {i} is {now and (now.name, now.kind.name)}, was {(name, kind)}"
        if has_default and now.default is inspect.Parameter.empty:
            return f"parameter {name!r} lost its default"
    new = [p.name for p in params[len(frozen["params"]):]
           if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"new parameters without a default: {new}" if new else None

HOME = os.path.dirname(os.path.abspath(picklehooks.__file__))

def resolve(module, name=None):
    # (the module, or its attribute name; None), or (None, why not). A module file from outside
    # this picklehooks (another checkout, through an editable install's finder) doesn't count.
    try:
        found = importlib.import_module(module)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    where = getattr(found, "__file__", None) or ""
    if os.path.isabs(where) and os.path.commonpath([HOME, os.path.abspath(where)]) != HOME:
        return None, f"found at {where}, outside this picklehooks ({HOME})"
    if name is not None and not hasattr(found, name):
        return None, f"module {module!r} has no attribute {name!r}"
    return (found if name is None else getattr(found, name)), None

# Op schemas: every frozen one still registered, unchanged (new ops may be added).
for key, schema in contract["op_schemas"].items():
    name, _, overload = key.removeprefix("picklehooks::").partition(".")
    try:
        now = str(getattr(getattr(torch.ops.picklehooks, name), overload or "default")._schema)
    except Exception as exc:
        now = f"missing ({type(exc).__name__}: {exc})"
    check("op_schemas", key, None if now == schema else f"is {now!r}, was {schema!r}")
for where, ops in contract["ops_called"].items():
    for op in ops:
        check("op_schemas", f"{op} (called by {where})",
              None if f"picklehooks::{op}" in contract["op_schemas"] else "not among the frozen schemas")

# Module paths: what saved files and archived runtime copies import by name on the host.
hub = contract["hub"]
for module in sorted({hub["module"], hub["shim"], *contract["hook_text_imports"],
                      *contract["host_modules_archives_defer_to"]}):
    check("module_paths", module, resolve(module)[1])
check("module_paths", "hub and shim names", None if (_shim.HUB_NAME, _shim.SHIM_NAME) == (hub["module"], hub["shim"])
      else f"are {(_shim.HUB_NAME, _shim.SHIM_NAME)}")
for letter in hub["format_letters"]:
    check("module_paths", f"format letter {letter!r}", None if letter in _shim.FORMATS else "unknown to the shim")
for file, names in [*contract["pickle_globals"].items(), ("the stub hub", contract["archive_hub_stub_imports"])]:
    for qualified in names:
        module, _, name = qualified.rpartition(".")
        found, why = resolve(module, name)
        if module == hub["module"]:  # a hook: the host's hub decodes it into a function of the hub
            check("module_paths", f"{file}: {module}.{name[:12]}...", why or (
                None if inspect.isfunction(found) and found.__module__ == module else f"resolves to {found!r}"))
        else:  # what archives name in their own copy of the shim, and new archives in this one
            check("module_paths", f"{file}: {qualified}", why)

# Entry points: what generated hook text and archived runtime copies call, under their module paths.
for module, names in contract["entry_points"].items():
    for name, frozen in names.items():
        obj, why = resolve(module, name)
        check("entry_points", f"{module}.{name}", why or fits(obj, frozen))

# The host's log, as an archive's copy of the runtime uses it.
log = picklehooks.Log()
for name, frozen in contract["log_members"].items():
    if name.startswith("__dict__["):  # a key the runtime keeps in the log's __dict__
        check("log_members", name, None if isinstance(getattr(log, "__dict__", None), dict) else "Log has no __dict__")
    else:  # methods on the class, attributes on a new log
        owner = picklehooks.Log if frozen["kind"] == "function" else log
        check("log_members", name, fits(getattr(owner, name), frozen) if hasattr(owner, name) else "missing")

# Flag bits, baked into generated hook text and graphs as integers.
from picklehooks import _ops
for name, value in contract["flags"].items():
    check("flags", name, None if getattr(_ops, name, None) == value else f"is {getattr(_ops, name, None)}, was {value}")

# Attributes instrument() sets, which saved modules and parameters carry.
model = torch.nn.Sequential(torch.nn.Linear(2, 2))
picklehooks.instrument(model, capture=("output", "param_grad"))
carried = set(model[0].__dict__) | set(model[0].weight.__dict__)
for name in contract["saved_attributes"]:
    check("saved_attributes", name, None if name in carried else "instrument() no longer sets it")

print(json.dumps({"problems": problems, "checked": checked}))
"""

SURFACES = ("op_schemas", "module_paths", "entry_points", "log_members", "flags", "saved_attributes")


@pytest.fixture(scope="module")
def surfaces() -> dict:
    """Every surface of wire_contract.json, checked once in a fresh process."""
    return json.loads(run_fresh(CHECK, str(FROZEN / "wire_contract.json"), cwd=REPO).strip().splitlines()[-1])


@pytest.mark.parametrize("surface", SURFACES)
def test_contract_surface_is_unchanged(surface, surfaces):
    """Everything frozen of this surface is still there, unchanged, under its name (new entries may be added)."""
    assert surfaces["checked"].get(surface, 0) > 0, f"nothing of {surface} was checked"
    assert not surfaces["problems"].get(surface), "\n".join(surfaces["problems"][surface])


def test_statistics_are_the_frozen_ones_renamed():
    """The kernels' statistics are the frozen ones in the frozen order (wire); records name them
    by the documented renaming only."""
    import picklehooks.capture.record as record
    from picklehooks import _stats

    assert list(_stats.STAT_NAMES) == CONTRACT["stat_names"]
    assert list(record.STAT_NAMES) == _now(CONTRACT["stat_names"])
    assert record.RENAMED_STATS == RENAMED_STATS


def test_contract_names_what_the_artifacts_use():
    """The frozen lists hold what the artifacts depend on (a regenerated file must read them off again)."""
    assert CONTRACT["ops_called"]["script.pt"] and CONTRACT["ops_called"]["export.pt2"]
    assert CONTRACT["entry_points"]["picklehooks._hookrt"] and CONTRACT["host_modules_archives_defer_to"]
    assert {"_add_tensor", "_note_call"} <= set(CONTRACT["log_members"])
    assert CONTRACT["hub"]["letters_in_artifacts"] == ["a"] and CONTRACT["pickle_globals"]["save.pt"]
