"""Statistics of recorded copies, computed in batches on their device and read in one transfer.

A record whose statistics can't be computed at once (a tensor on another
device, a dtype the native pass doesn't read, no extension) is copied into a
row of a preallocated matrix per (device, dtype, shape): a :class:`_Group`.
The log's :class:`_Pending` reduces every group the first time any record's
statistics are read, or once the copies pass :data:`PENDING_BYTES`, and
brings all of them to the host in one transfer per device: no host
synchronisation per hook.

Limits: a group's rows are padded to :data:`~picklehooks._stats.PAD`
elements, so small tensors cost up to that much memory each until reduced.
"""

from __future__ import annotations

import torch

from .._stats import PAD, finish, matrix_stats

__all__ = ["PENDING_BYTES"]

#: Bytes of recorded copies a log keeps for batched statistics before reducing them.
PENDING_BYTES = 64 << 20


class _Group:
    """Copies of recorded tensors of one (device, dtype, shape), in the rows of one preallocated matrix.

    Copying into a row allocates nothing, and the statistics of all rows come
    from a handful of row-wise reductions. Rows are padded with zeros to a
    multiple of :data:`~picklehooks._stats.PAD` elements, which makes zeros
    quick to count.
    """

    __slots__ = ("data", "views", "used", "table", "rows")

    def __init__(self, like: torch.Tensor, capacity: int) -> None:
        n = like.numel()
        self.data = torch.empty((capacity, n + -n % PAD), dtype=like.dtype, device=like.device)
        self.data[:, n:].zero_()
        # Every row as a tensor of the recorded shape, made in one call.
        self.views = self.data[:, :n].view(capacity, *like.shape).unbind(0)
        self.used = 0
        self.table: torch.Tensor | None = None  # on the device, once reduced
        self.rows: list[list[float]] | None = None  # on the host, once read

    @classmethod
    def of_table(cls, table: torch.Tensor) -> _Group:
        """A group of one row whose statistics were computed elsewhere (by a compiled graph)."""
        group = cls.__new__(cls)
        group.data = group.views = group.rows = None
        group.used, group.table = 1, table.view(1, -1)
        return group

    def reduce(self, *, exact: bool) -> torch.Tensor:
        """Compute the table (no sync), release the copies; return the matrix reduced."""
        n = self.views[0].numel()
        x = self.data[: self.used, :n]
        self.table = matrix_stats(x, exact=exact, padded=self.data[: self.used])
        self.data = self.views = None
        return x


class _Pending:
    """A log's statistics not yet computed or not yet read.

    Records point here and this points at no record, so a log, its records
    and its copies are freed by reference counting the moment they are
    dropped; a reference cycle would keep every copy until the garbage
    collector ran.
    """

    __slots__ = ("filling", "unreduced", "reduced", "seen", "bytes")

    def __init__(self) -> None:
        self.filling: dict[tuple, _Group] = {}  # the group taking new rows, per (device, dtype, shape)
        self.unreduced: list[_Group] = []  # every group holding copies
        self.reduced: list[_Group] = []  # with a table, not yet read
        self.seen: dict[tuple, int] = {}  # rows recorded per key
        self.bytes = 0

    def add(self, x: torch.Tensor) -> tuple[_Group, torch.Tensor]:
        """Copy ``x`` into a row; return its group and the row (as a tensor shaped like ``x``)."""
        key = (x.device, x.dtype, x.shape)
        group = self.filling.get(key)
        seen = self.seen[key] = self.seen.get(key, 0) + 1
        if group is None or group.used == len(group.views):
            size = x.numel() * x.element_size()
            # A model records the same shapes every step: size the group for what the
            # last log recorded, and grow fourfold while that isn't enough.
            capacity = max(_CAPACITY.get(key, 4), 4 * (len(group.views) if group else 0))
            group = self.filling[key] = _Group(x, max(1, min(capacity, PENDING_BYTES // size)))
            self.unreduced.append(group)
        row = group.views[group.used]
        row.copy_(x)
        group.used += 1
        if seen > _CAPACITY.get(key, 0):
            if len(_CAPACITY) >= 1024:  # e.g. a shape per sequence length: forget, don't grow
                _CAPACITY.clear()
            _CAPACITY[key] = seen
        self.bytes += x.numel() * x.element_size()
        if self.bytes > PENDING_BYTES:
            self.reduce(exact=True)
        return group, row

    def add_table(self, stats: torch.Tensor) -> _Group:
        """Keep statistics computed on the device (no copy of the value, no sync); read with the rest."""
        group = _Group.of_table(stats)
        self.reduced.append(group)
        return group

    def reduce(self, *, exact: bool) -> dict[int, torch.Tensor]:
        """Turn every group's copies into a table on its device (no sync); return the matrices by group id."""
        done = {id(group): group.reduce(exact=exact) for group in self.unreduced}
        self.reduced += self.unreduced
        self.filling, self.unreduced, self.bytes = {}, [], 0
        return done

    def read(self) -> None:
        """Bring every table to the host, one transfer per device; complete the fast rows."""
        matrices = self.reduce(exact=False)
        by_device: dict[torch.device, list[_Group]] = {}
        for group in self.reduced:
            by_device.setdefault(group.table.device, []).append(group)
        self.reduced = []
        for groups in by_device.values():
            rows = torch.cat([group.table for group in groups]).cpu().tolist()
            for group in groups:
                group.rows, rows = rows[: len(group.table)], rows[len(group.table):]
                if id(group) in matrices:  # reduced just now, on the fast path
                    finish(matrices[id(group)], group.rows)
                group.table = None


# Rows recorded per (device, dtype, shape) by the last log, to size the next log's groups.
_CAPACITY: dict[tuple, int] = {}


class _PendingRow(tuple):
    """``(pending, group, row)``: where a batched record's statistics will be (see :class:`_Pending`).

    A type of its own, so that a record's source tells it from the plain tuple
    of values a hook computed, which is what nearly every record holds.
    """

    __slots__ = ()


def _read_pending(src: _PendingRow) -> list[float]:
    """The statistics of a batched record; the first read of a log's brings all of
    its pending statistics to the host (one transfer per device)."""
    pending, group, row = src
    if group.rows is None:
        pending.read()
    return group.rows[row]


# Records read from a log's rows are built by _speedups.build_records (csrc/records.c), which fills the
# slots of a new instance without calling __init__: keep __init__ the one dataclass writes. The builder
# checks the fields and __post_init__ (picklehooks._native.record_builder), and tests/runtime/test_record_builder.py
