"""Statistics of recorded copies, computed in batches on their device and read in one transfer.

A record whose statistics can't be computed at once (a tensor on another
device, a dtype the native pass doesn't read, no extension) is copied into
a segment of a preallocated buffer per (device, dtype): an :class:`_Arena`.
Recording is that one copy. The log's :class:`_Pending` reduces every arena
the first time any record's statistics are read, and before a copy that
would pass :data:`PENDING_BYTES` the arenas holding a sixteenth of it or
more, with :func:`~picklehooks._stats.segment_stats`: a fixed number of
kernels per arena and block, however many shapes were recorded, and one
host-to-device transfer of the arena's layout, one entry per record (the
device works out which chunk is whose).
All tables come to the host in one transfer per device: no host
synchronisation per hook, and none before the first read.

Limits: each copy is padded to a multiple of :data:`~picklehooks._stats.PAD`
elements, so small tensors cost up to that much memory each until reduced;
an arena holds at least :data:`_MIN_ARENA` elements, and at most
:data:`PENDING_BYTES` (a larger tensor gets an arena of its own). A log's
first arenas are sized by growing fourfold, later logs' from what the
largest one recorded (:data:`_CAPACITY`), so a log reduces one arena per
(device, dtype) once the model's recording has been seen. A copy kept as a
record's tensor (``mode="tensor"``) is a view of its arena and keeps all of
it in memory.
"""

from __future__ import annotations

from array import array
from itertools import accumulate

import torch

from .._stats import EMPTY, PAD, segment_stats

__all__ = ["PENDING_BYTES"]

#: Bytes of recorded copies (padding included) a log keeps for batched statistics before reducing
#: them. Each reduction costs a fixed number of kernels (about 25, and 20 per block of up to 16M
#: values): recording every value of a GPT-2-small step copies about 1.4 GB, which took ten
#: reductions at this size (counted with PICKLEHOOKS_NATIVE=0).
PENDING_BYTES = 256 << 20

# Elements an arena holds at least: a log's first arena of a dtype starts here, not at one tensor's size.
_MIN_ARENA = 1 << 16


class _Arena:
    """Copies of recorded tensors of one (device, dtype), each in its own segment of one preallocated buffer.

    A segment starts at a multiple of :data:`~picklehooks._stats.PAD`
    elements and the buffer is zeroed when allocated, so the copies, their
    padding included, are the rows of a ``(chunks, PAD)`` matrix. Copying
    in is one kernel and allocates nothing. ``used`` counts the records, and
    a record's statistics are row ``i`` of the table (``rows`` once read).
    """

    __slots__ = ("data", "capacity", "end", "sizes", "used", "table", "rows")

    def __init__(self, like: torch.Tensor, capacity: int) -> None:
        self.data = torch.zeros(capacity, dtype=like.dtype, device=like.device)
        self.capacity = capacity  # len(self.data), which is a Python method of Tensor: about 1 µs
        self.end = 0  # elements taken, a multiple of PAD
        self.sizes: list[int] = []  # elements of each record, in order
        self.used = 0
        self.table: torch.Tensor | None = None  # on the device, once reduced
        self.rows: list[list[float]] | None = None  # on the host, once read

    @classmethod
    def of_table(cls, table: torch.Tensor) -> _Arena:
        """An arena of one record whose statistics were computed elsewhere (a compiled graph, or none to compute)."""
        arena = cls.__new__(cls)
        arena.data = arena.sizes = arena.rows = None
        arena.capacity, arena.end, arena.used, arena.table = 0, 0, 1, table.view(1, -1)
        return arena

    def add(self, x: torch.Tensor) -> torch.Tensor:
        """Copy ``x`` (non-empty, fitting) into the next segment; return the copy, shaped like ``x``."""
        n = x.numel()
        # One view op, not a slice and a view: the hook's time on the host is per operator.
        strides = x.stride() if x.is_contiguous() else _contiguous_strides(x.shape)
        row = self.data.as_strided(x.shape, strides, self.end)
        row.copy_(x)
        self.end += n + -n % PAD
        self.sizes.append(n)
        self.used += 1
        return row

    def held(self) -> int:
        """Bytes of the buffer its copies take, their padding included."""
        return self.end * self.data.element_size()

    def reduce(self) -> None:
        """Compute the table on the device (no sync) and release the buffer.

        The host sends what it knows per record, in one transfer: where each record's chunks end,
        its last chunk and the values in it, its size. The per-chunk layout that
        :func:`segment_stats` reads is built from that on the device, so the host's work is per
        record, not per chunk (a GPT-2-small step records ~1.4M chunks)."""
        sizes, r = self.sizes, len(self.sizes)
        ends = list(accumulate(-(-n // PAD) for n in sizes))
        last = [e - 1 for e in ends]
        rest = [n - (e - b) * PAD + PAD for n, b, e in zip(sizes, [0, *ends], ends)]  # values in the last chunk
        host = bytearray(array("q", ends + last + rest).tobytes() + array("d", sizes).tobytes())
        chunks, device = ends[-1], self.data.device
        layout = _to_device(torch.frombuffer(host, dtype=torch.int64), device)
        # Chunk c is record i's when ends[i - 1] <= c < ends[i]; every chunk is full but each record's last.
        segment = torch.searchsorted(layout[:r], torch.arange(chunks, device=device), right=True)
        valid = torch.full((chunks,), PAD, dtype=torch.int64, device=device).index_copy_(0, layout[r : 2 * r],
                                                                                        layout[2 * r : 3 * r])
        self.table = segment_stats(self.data[: chunks * PAD], segment, valid, layout[3 * r :].view(torch.float64))
        self.data = self.sizes = None


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    stride, strides = 1, []
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return tuple(reversed(strides))


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without the host waiting: a copy from pinned memory is asynchronous on CUDA
    (from pageable memory it would synchronise), and the pinned block isn't reused before the copy ends."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class _Pending:
    """A log's statistics not yet computed or not yet read.

    Records point here and this points at no record, so a log, its records
    and its copies are freed by reference counting the moment they are
    dropped; a reference cycle would keep every copy until the garbage
    collector ran.
    """

    __slots__ = ("filling", "unreduced", "reduced", "seen", "bytes")

    def __init__(self) -> None:
        self.filling: dict[tuple, _Arena] = {}  # the arena taking new copies, per (device, dtype)
        self.unreduced: list[_Arena] = []  # every arena holding copies
        self.reduced: list[_Arena] = []  # with a table, not yet read
        self.seen: dict[tuple, int] = {}  # elements (padded) recorded per key
        self.bytes = 0  # held by the unreduced arenas' copies, padding included (their held())

    def add(self, x: torch.Tensor) -> tuple[_Arena, torch.Tensor]:
        """Copy ``x`` into an arena; return the arena (``x``'s statistics are its last row) and the copy,
        shaped like ``x``."""
        if not x.numel():  # nothing to copy or reduce
            return self.add_table(torch.tensor(EMPTY, dtype=torch.float64)), x.clone()
        key = (x.device, x.dtype)
        n = x.numel()
        padded = n + -n % PAD
        nbytes = padded * x.element_size()  # as the arena will hold it
        if self.bytes and self.bytes + nbytes > PENDING_BYTES:
            # Reduce before this copy, not after: a new arena started for it would be allocated
            # (and zeroed) at full size only to be reduced at the next copy.
            self.reduce(everything=False)
        seen = self.seen[key] = self.seen.get(key, 0) + padded
        arena = self.filling.get(key)
        if arena is None or arena.end + padded > arena.capacity:
            # A model records the same tensors every step: size the arena for what the largest log
            # recorded, and grow fourfold while that isn't enough; past PENDING_BYTES only to fit x.
            capacity = max(_CAPACITY.get(key, 0), 4 * arena.capacity if arena else 0, _MIN_ARENA)
            capacity = max(padded, min(capacity, PENDING_BYTES // x.element_size()))
            arena = self.filling[key] = _Arena(x, capacity + -capacity % PAD)
            self.unreduced.append(arena)
        row = arena.add(x)
        _CAPACITY[key] = max(seen, _CAPACITY.get(key, 0))
        self.bytes += nbytes
        return arena, row

    def add_table(self, stats: torch.Tensor) -> _Arena:
        """Keep statistics computed on the device (no copy of the value, no sync); read with the rest."""
        arena = _Arena.of_table(stats)
        self.reduced.append(arena)
        return arena

    def reduce(self, everything: bool = True) -> None:
        """Turn the arenas' copies into tables on their devices (no sync). Unless ``everything``, an
        arena holding under a sixteenth of :data:`PENDING_BYTES` keeps filling: a reduction's kernels
        are a fixed number per arena, and the few integer values a model records (token ids,
        positions) would pay them at every reduction of its float activations."""
        kept = [] if everything else [a for a in self.unreduced if a.held() < PENDING_BYTES // 16]
        for arena in self.unreduced:
            if arena not in kept:
                arena.reduce()
                self.reduced.append(arena)
        self.filling = {key: arena for key, arena in self.filling.items() if arena in kept}
        self.unreduced, self.bytes = kept, sum(a.held() for a in kept)

    def read(self) -> None:
        """Bring every table to the host, one transfer per device."""
        self.reduce()
        by_device: dict[torch.device, list[_Arena]] = {}
        for arena in self.reduced:
            by_device.setdefault(arena.table.device, []).append(arena)
        self.reduced = []
        for arenas in by_device.values():
            rows = torch.cat([arena.table for arena in arenas]).cpu().tolist()
            start = 0
            for arena in arenas:
                arena.rows, start = rows[start : start + arena.used], start + arena.used
                arena.table = None


# Elements (padded) recorded per (device, dtype) by the largest log so far, to size the next log's arenas.
_CAPACITY: dict[tuple, int] = {}


class _PendingRow(tuple):
    """``(pending, arena, i)``: where a batched record's statistics will be (see :class:`_Pending`).

    A type of its own, so that a record's source tells it from the plain tuple
    of values a hook computed, which is what nearly every record holds.
    """

    __slots__ = ()


def _read_pending(src: _PendingRow) -> list[float]:
    """The statistics of a batched record; the first read of a log's brings all of
    its pending statistics to the host (one transfer per device)."""
    pending, arena, i = src
    if arena.rows is None:
        pending.read()
    return arena.rows[i]


# Records read from a log's rows are built by _speedups.build_records (csrc/records.c), which fills the
# slots of a new instance without calling __init__: keep __init__ the one dataclass writes. The builder
# checks the fields and __post_init__ (picklehooks._native.record_builder), and tests/runtime/test_record_builder.py
