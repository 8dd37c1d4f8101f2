"""Child process of tests/audit/test_oracle.py: loads pickles as CPython does and reports the globals resolved.

Reads one file path per line on stdin and answers one JSON line per path: for each way of
loading (``loads``: ``pickle.loads`` of the bytes; ``bytesio``: ``pickle.load`` from ``BytesIO``,
as ``torch.load`` reads ``data.pkl``; ``file``: ``pickle.load`` from ``open()``), the
``pickle.find_class`` audit events CPython raised, in order, and how the load ended. The
``bytesio`` and ``file`` ways load pickles one after another, as a stream reader does, and
also answer the events and ending of their first pickle alone (``bytesio first``, ``file first``),
which is what ``loads`` reads.

No global from the file ever runs: the audit hook raises as soon as a global outside the fake
module ``phfuzz`` is resolved (before ``find_class`` returns it), and ``phfuzz``'s attributes
are :class:`Inert`, which accepts any call, state or item and does nothing. Memory is capped.
"""

from __future__ import annotations

import io
import json
import pickle
import resource
import sys
import types

FAKE = "phfuzz"


class Stop(Exception):
    """Raised by the audit hook: a real global was resolved; the load stops before using it."""


class Inert:
    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return Inert()

    def __setstate__(self, state):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass

    def add(self, item):
        pass

    def __setitem__(self, key, value):
        pass


events: list[list[str]] = []


def hook(event: str, args: tuple) -> None:
    if event == "pickle.find_class":
        module, name = args
        events.append([str(module), str(name)])
        if module != FAKE:
            raise Stop(f"{module}.{name}")


def load_all(f, limit: int = 8) -> tuple[str, list[list[str]], str]:
    """Load pickles until the file ends or one fails: the ending, and the first pickle's events and ending."""
    first: tuple[list[list[str]], str] | None = None
    outcome = "ok"
    for _ in range(limit):
        if not f.read(1):
            break
        f.seek(-1, 1)
        try:
            pickle.load(f)
        except BaseException as exc:  # noqa: BLE001 - any failure ends the load, as it would torch.load
            outcome = type(exc).__name__
        first = first or (list(events), outcome)
        if outcome != "ok":
            break
    return (outcome, *(first or ([], "EOFError")))


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    fake = types.ModuleType(FAKE)
    fake.getcwd = fake.system = Inert
    fake.sub = types.SimpleNamespace(getcwd=Inert)
    sys.modules[FAKE] = fake
    sys.addaudithook(hook)
    for line in sys.stdin:
        path = line.rstrip("\n")
        with open(path, "rb") as f:
            data = f.read()
        answer = {}
        for way in ("loads", "bytesio", "file"):
            events.clear()
            if way == "loads":
                try:
                    pickle.loads(data)
                    outcome = "ok"
                except BaseException as exc:  # noqa: BLE001
                    outcome = type(exc).__name__
            else:
                with io.BytesIO(data) if way == "bytesio" else open(path, "rb") as f:
                    outcome, first_events, first_outcome = load_all(f)
                answer[f"{way} first"] = [first_events, first_outcome]
            answer[way] = [list(events), outcome]
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
