"""Structure opcodes: the stack, MARK, the memo, and the containers they build.

The handlers mirror ``pickle._Unpickler``'s stack, mark and memo discipline,
so that what ends up where matches a real load: lists, tuples, dicts and
sets are built from what is on the stack; ``APPEND(S)``, ``SETITEM(S)`` and
``ADDITEMS`` on something that is not a container a load would fill (a
call's result, whose ``__setitem__`` or ``append`` a load would run) keep
the values visible in the machine's ``dropped`` list, so they are still
audited.

Limits: the symbolic containers are not real ones: a dict keeps every pair
(unhashable or repeated keys included), and nothing checks what a real
``__setitem__`` or ``extend`` would refuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ._limits import show
from ._literals import memo_index
from ._stream import Malformed
from ._values import Node, PDict, PSet

if TYPE_CHECKING:
    from ._machine import Machine


def stack_opcodes(m: Machine) -> dict[str, Callable[[], Any]]:
    """The handlers of the stack, mark, memo and container opcodes, keyed by opcode."""
    push, pop, top, pop_mark, read, line = m._push, m._pop, m._top, m._pop_mark, m._read, m._line

    def set_items(flat: list[Any]) -> None:
        if len(flat) % 2:
            raise Malformed(f"odd number of items for SETITEMS at byte {m.pos - 1}")
        target = top()
        pairs = list(zip(flat[::2], flat[1::2]))
        if isinstance(target, PDict):
            target.pairs.extend(pairs)
        elif isinstance(target, Node):
            target.dictitems.extend(pairs)
        else:  # a real load would call the target's __setitem__; keep the values visible
            m.dropped.extend(flat)

    def add_items(items: list[Any]) -> None:
        target = top()
        if isinstance(target, list):
            target.extend(items)
        elif isinstance(target, PSet):
            target.items.extend(items)
        elif isinstance(target, Node):
            target.items.extend(items)
        else:
            m.dropped.extend(items)

    def mark() -> None:
        m.metastack.append(m.stack)
        m.stack = []

    def stop() -> bool:
        return True

    def pop_op() -> None:
        if m.stack:
            m.dropped.append(pop())
        else:  # pickle pops the mark when the stack above it is empty
            m.dropped.extend(pop_mark())

    def memo_get(key: int) -> None:
        if key not in m.memo:
            raise Malformed(f"memo key {show(key)} read before it was written, at byte {m.pos - 1}")
        push(m.memo[key])

    def memo_put(key: int) -> None:
        if key < 0:
            raise Malformed(f"negative memo key {show(key)} at byte {m.pos - 1}")
        m.memo[key] = top()

    def tuple_n(n: int):
        def op() -> None:
            if len(m.stack) < n:
                raise Malformed(f"stack underflow at byte {m.pos - 1}")
            items = m.stack[-n:]
            del m.stack[-n:]
            push(tuple(items))

        return op

    def dict_op() -> None:
        flat = pop_mark()
        if len(flat) % 2:
            raise Malformed(f"odd number of items for DICT at byte {m.pos - 1}")
        push(PDict(zip(flat[::2], flat[1::2])))

    def setitem() -> None:
        value, key = pop(), pop()
        set_items([key, value])

    def append() -> None:
        add_items([pop()])

    return {
        "(": mark,
        ".": stop,
        "0": pop_op,
        "1": lambda: m.dropped.extend(pop_mark()),
        "2": lambda: push(top()),
        "a": append,
        "d": dict_op,
        "}": lambda: push(PDict()),
        "e": lambda: add_items(pop_mark()),
        "g": lambda: memo_get(memo_index(line())),
        "h": lambda: memo_get(read(1)[0]),
        "j": lambda: memo_get(m._uint(4)),
        "l": lambda: push(pop_mark()),
        "]": lambda: push([]),
        "p": lambda: memo_put(memo_index(line())),
        "q": lambda: memo_put(read(1)[0]),
        "r": lambda: memo_put(m._uint(4)),
        "s": setitem,
        "t": lambda: push(tuple(pop_mark())),
        ")": lambda: push(()),
        "u": lambda: set_items(pop_mark()),
        "\x85": tuple_n(1),
        "\x86": tuple_n(2),
        "\x87": tuple_n(3),
        "\x8f": lambda: push(PSet(frozen=False)),
        "\x90": lambda: add_items(pop_mark()),
        "\x91": lambda: push(PSet(True, pop_mark())),
        "\x94": lambda: m.memo.__setitem__(len(m.memo), top()),
    }
