"""The wire contract's version 3 (docs/contract.md): programs traced, exported or scripted since
issue #39 record each module call's source, and keep recording it.

tests/data/make_frozen_v3.py wrote tests/data/frozen_v3/: a traced, an exported and a scripted
instrumented ``ThreePlaces`` (one ``Identity`` called from three lines), the first two of whose
graphs call ``picklehooks::call_site``; the records of one step each made, loaded in a fresh
process; and the op's schema and the ``Log`` members the kernels call. Each artifact is loaded here in a fresh
process by the code of the day. Version 2 (test_wire_contract.py) covers everything else.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from picklehooks.capture.log import Log
from tests.contract import frozen_v3_step
from tests.testutils import REPO, run_fresh

FROZEN = REPO / "tests" / "data" / "frozen_v3"
EXPECTED = json.loads((FROZEN / "expected.json").read_text())
ARTIFACTS = {"trace": "trace.pt", "export": "export.pt2", "script": "script.pt"}


def test_the_op_and_the_log_member_are_as_frozen():
    assert str(torch.ops.picklehooks.call_site.default._schema) == EXPECTED["op_schema"]
    assert [f"{name}{inspect.signature(getattr(Log, name))}" for name in ("_call_site", "_script_site")] \
        == EXPECTED["log_members"]


def _root_line() -> str:
    """Where :func:`frozen_v3_step.run_step` calls the model: the root's site, found when it runs."""
    lines, first = inspect.getsourcelines(frozen_v3_step.run_step)
    line = first + next(i for i, text in enumerate(lines) if "# the root's call site" in text)
    return f"tests/contract/frozen_v3_step.py:{line} in run_step"


@pytest.mark.parametrize("which", sorted(ARTIFACTS))
def test_a_frozen_program_records_the_sources_it_was_saved_with(which):
    """Every record with the source the program carries; the root's names the line that calls it now
    (its class, as frozen). Sorted by key: gradients come in the order autograd chooses."""
    out = run_fresh(frozen_v3_step.CHILD, which, str(FROZEN / ARTIFACTS[which]), str(REPO), cwd=REPO)
    got = sorted(json.loads(out.strip().splitlines()[-1]), key=lambda row: row[:4])
    want = sorted(EXPECTED["records"][which], key=lambda row: row[:4])
    assert [row[:4] for row in got] == [row[:4] for row in want]
    assert all(row[4] is not None for row in got)
    for g, w in zip(got, want):
        if g[0] == "":  # the root: the calling line is the one that calls the program here
            assert g[4] == f"{_root_line()} ({w[4].split(' (', 1)[1]}", g
        else:
            assert g[4] == w[4], g[:4]
