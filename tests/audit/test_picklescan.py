"""``inspect`` flags every file of the hostile corpus that ``picklescan`` flags.

picklescan (a dev dependency; skipped when absent) keeps a table of
dangerous globals; inspect marks everything outside torch's weights_only
allowlist, so it should be the stricter of the two on every file.
"""

from __future__ import annotations

import pytest

from picklehooks import audit
from tests.audit.test_corpus import CASES, build

scanner = pytest.importorskip("picklescan.scanner")


@pytest.mark.parametrize("name", CASES)
def test_flagged_by_picklescan_means_flagged_by_inspect(tmp_path, name):
    """Whatever picklescan calls dangerous (or can't scan), inspect reports UNSAFE or incomplete."""
    case = build(name, tmp_path)
    theirs = scanner.scan_file_path(str(case.path))
    flagged = theirs.issues_count > 0 or theirs.infected_files > 0 or theirs.scan_err
    try:
        ours = audit.audit_file(case.path).exit_code
    except audit.AuditError:
        ours = audit.EXIT_UNREADABLE
    if flagged:
        assert ours & (audit.EXIT_UNSAFE | audit.EXIT_INCOMPLETE | audit.EXIT_UNREADABLE), (name, theirs.globals)
    assert not case.marker.exists()


def test_corpus_is_not_trivially_clean():
    """picklescan flags most of the corpus, so the test above compares something."""
    import tempfile
    from pathlib import Path

    flagged = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            folder = Path(tmp) / name
            folder.mkdir()
            result = scanner.scan_file_path(str(build(name, folder).path))
            flagged += result.issues_count > 0 or result.scan_err
    assert flagged >= len(CASES) // 2
