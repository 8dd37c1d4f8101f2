"""Statistics of recorded values, computed in batches on their device and read in one transfer.

A record whose statistics can't be computed at once (a tensor on another
device, a dtype the native pass doesn't read, no extension) is kept by
reference with its version counter, in one batch per (device, dtype)
(:class:`_Refs`): recording dispatches no operator. When reduced, a batch's
values are laid out in one buffer by one operator (``torch._chunk_cat``),
each padded to whole chunks of :data:`~picklehooks._stats.PAD` values, and
reduced by :func:`~picklehooks._stats.segment_stats`: a fixed number of
kernels per batch and block, however many shapes were recorded, and one
host-to-device transfer of the layout, one entry per record (the device
works out which chunk is whose). The log's :class:`_Pending` reduces every
batch the first time any record's statistics are read, and before a value
that would pass :data:`PENDING_BYTES` the batches holding a sixteenth of it
or more. All tables come to the host in one transfer per device: no host
synchronisation per hook, and none before the first read.

A value changed in place between record and reduction (the output of a
BatchNorm that a ``ReLU(inplace=True)`` then changes, a block's output
before ``+= residual``) must never be reported with its later value. A
site (module, kind, path) seen for the first time gets a ``clone`` in the
batch, and its original is watched until the next reduction: the first
recorded step learns which sites a later operator changes, without losing
a record, and those sites are cloned from then on (:data:`_SITES`). A site
learned as safe whose value changes later (data-dependent code) loses that
one record: the version counter tells, its ``stats`` are ``None``, reading
warns, and the site is cloned from then on.

A value of an eighth of :data:`PENDING_BYTES` or more (an embedding matrix,
logits over a vocabulary) is reduced alone when recorded (a few dozen
kernels; no copy, and small float64 blocks). A record's kept
``mode="tensor"`` value is copied into a segment of a preallocated buffer
per (device, dtype), an :class:`_Arena`, whose rows are its statistics.

Limits: values kept by reference count twice towards :data:`PENDING_BYTES`
(the values, and the buffer their reduction lays them out in); the
reduction's float64 block (at most 128 MiB) comes on top. Padding costs up
to :data:`~picklehooks._stats.PAD` values per record until reduced. What a
site needs is learned per process by name, across models: a site that
shares its name with another model's may lose one record before it is
cloned. An arena holds at least :data:`_MIN_ARENA` elements, and at most
:data:`PENDING_BYTES` (a larger tensor gets an arena of its own); a log's
first arenas are sized by growing fourfold, later logs' from what the
largest one recorded (:data:`_CAPACITY`). A copy kept as a record's tensor
is a view of its arena and keeps all of it in memory.
"""

from __future__ import annotations

import warnings
from array import array
from itertools import accumulate

import torch

from .._stats import EMPTY, PAD, matrix_stats, segment_stats

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
    lost = ()  # a copy can't be changed by anyone else (see _Refs.lost)

    def __init__(self, like: torch.Tensor, capacity: int) -> None:
        self.data = torch.zeros(capacity, dtype=like.dtype, device=like.device)
        self.capacity = capacity  # len(self.data), which is a Python method of Tensor: about 1 µs
        self.end = 0  # elements taken, a multiple of PAD
        self.sizes: list[int] = []  # elements of each record, in order
        self.used = 0
        self.table: torch.Tensor | None = None  # on the device, once reduced
        self.rows: list[list[float]] | None = None  # on the host, once read

    @classmethod
    def of_table(cls, table: torch.Tensor | None) -> _Arena:
        """An arena of one record whose statistics were computed elsewhere (a compiled graph, or none
        to compute); ``None``: the rows a lent batch stacks when it is given back
        (:meth:`_Pending.give_back`)."""
        arena = cls.__new__(cls)
        arena.data = arena.sizes = arena.rows = None
        arena.capacity, arena.end, arena.used = 0, 0, 1
        arena.table = None if table is None else table.view(1, -1)
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

    def buffers(self) -> list[torch.Tensor]:
        return [] if self.data is None else [self.data]

    def reduce(self) -> None:
        """Compute the table on the device (no sync) and release the buffer."""
        self.table = _segment_table(self.data, self.sizes)
        self.data = self.sizes = None


class _Refs:
    """Recorded values of one (device, dtype), kept by reference (no copy) until reduced.

    ``used``, ``table`` and ``rows`` as an :class:`_Arena`'s; ``lost``: the
    (index, site) of each value changed in place before the reduction, whose
    row :meth:`_Pending.read` drops.
    """

    __slots__ = ("values", "versions", "sites", "sizes", "end", "used", "element_size", "table", "rows", "lost")

    def __init__(self, like: torch.Tensor) -> None:
        self.values: list[torch.Tensor] = []
        self.versions: list[int | None] = []
        self.sites: list[tuple] = []
        self.sizes: list[int] = []
        self.end = 0  # elements the reduction's buffer will take, a multiple of PAD
        self.used = 0
        self.element_size = like.element_size()
        self.table: torch.Tensor | None = None
        self.rows: list | None = None
        self.lost: list[tuple[int, tuple]] = []  # (index, site), set when reduced

    def add(self, x: torch.Tensor, site: tuple, version: int | None) -> None:
        """Keep ``x``; ``version``: its version counter now, or ``None`` for a copy nothing else holds."""
        n = x.numel()
        self.values.append(x)
        self.versions.append(version)
        self.sites.append(site)
        self.sizes.append(n)
        self.end += n + -n % PAD
        self.used += 1

    def __getstate__(self) -> dict:
        # A record pickled before its statistics are read (distributed.gather sends records so)
        # carries its batch; the copies' version counters restart, so keep whether each changed.
        state = {name: getattr(self, name) for name in self.__slots__}
        if self.values is not None:
            state["versions"] = [v is None or x._version == v for x, v in zip(self.values, self.versions)]
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        if self.values is not None:
            self.versions = [x._version if same else -1 for x, same in zip(self.values, self.versions)]

    def held(self) -> int:
        """Bytes the values take, and as many again for the buffer the reduction lays them out in."""
        return _REF_FACTOR * self.end * self.element_size

    def buffers(self) -> list[torch.Tensor]:
        return list(self.values or ())

    def reduce(self) -> None:
        """Lay the values out in one buffer (one operator, :func:`_lay_out`), each padded to whole
        chunks with a cached block of zeros, and compute the table on the device (no sync)."""
        self.lost = [(i, site) for i, (x, v, site) in enumerate(zip(self.values, self.versions, self.sites))
                     if v is not None and x._version != v]
        for _, site in self.lost:
            _SITES[site] = False
        pieces = []
        for x, n in zip(self.values, self.sizes):
            pieces.append(x if x.dim() else x.reshape(1))
            if n % PAD:
                pieces.append(_zeros(PAD - n % PAD, x))
        with torch.no_grad():
            data = _lay_out(pieces)
        del pieces
        sizes, self.values = self.sizes, None  # freed before the reduction's working memory is taken
        self.table = _segment_table(data, sizes)
        self.versions = self.sites = self.sizes = None


def _segment_table(data: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The statistics of the records laid out in ``data`` (each padded to whole chunks), on its device.

    The host sends what it knows per record, in one transfer: where each record's chunks end,
    its last chunk and the values in it, its size. The per-chunk layout that
    :func:`segment_stats` reads is built from that on the device, so the host's work is per
    record, not per chunk (a GPT-2-small step records ~1.4M chunks)."""
    r = len(sizes)
    ends = list(accumulate(-(-n // PAD) for n in sizes))
    last = [e - 1 for e in ends]
    rest = [n - (e - b) * PAD + PAD for n, b, e in zip(sizes, [0, *ends], ends)]  # values in the last chunk
    host = bytearray(array("q", ends + last + rest).tobytes() + array("d", sizes).tobytes())
    chunks, device = ends[-1], data.device
    layout = _to_device(torch.frombuffer(host, dtype=torch.int64), device)
    # Chunk c is record i's when ends[i - 1] <= c < ends[i]; every chunk is full but each record's last.
    segment = torch.searchsorted(layout[:r], torch.arange(chunks, device=device), right=True)
    valid = torch.full((chunks,), PAD, dtype=torch.int64, device=device).index_copy_(0, layout[r : 2 * r],
                                                                                    layout[2 * r : 3 * r])
    return segment_stats(data[: chunks * PAD], segment, valid, layout[3 * r :].view(torch.float64))


def _lay_out(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces flattened, one after another: one dispatched operator for the whole batch
    (``torch._chunk_cat``, which flattens each piece as it copies it, FSDP2's one-kernel layout on
    CUDA), or a ``reshape`` per piece and a ``cat`` where torch lacks it. (On the CPU,
    ``_chunk_cat`` calls a ``reshape`` per piece itself, in C++.)"""
    if _CHUNK_CAT is not None:
        return _CHUNK_CAT(pieces, 0, 1).view(-1)
    return torch.cat([p.reshape(-1) for p in pieces])


_CHUNK_CAT = getattr(torch, "_chunk_cat", None)

# Zeros that pad a value to whole chunks, per (device, dtype, length): reused, so padding costs no operator.
_ZEROS: dict[tuple, torch.Tensor] = {}


def _zeros(n: int, like: torch.Tensor) -> torch.Tensor:
    key = (like.device, like.dtype, n)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(n, dtype=like.dtype, device=like.device)
    return z


# How many times a value kept by reference counts towards PENDING_BYTES: the value, and the buffer
# its reduction lays it out in. (The reduction's float64 block, twice a float32 layout's size up to
# 128 MiB, comes on top; counting it too took one reduction more per step, and GPT-2 small's peak,
# everything recorded, stayed 139 MB above the plain model's either way: tests/capture/test_pending_memory.py.)
_REF_FACTOR = 2

#: What a site's values need, by (module, kind, path), learned from the version counters of the
#: values it recorded: True, kept by reference until reduced; False, copied when recorded (a later
#: operator changes them in place). A site not here is copied, and its value watched until read.
_SITES: dict[tuple, bool] = {}


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

    __slots__ = ("filling", "unreduced", "reduced", "seen", "bytes", "watched", "lent")

    def __init__(self) -> None:
        # The batch taking new values, per (device, dtype, by reference): an _Arena or _Refs.
        self.filling: dict[tuple, _Arena | _Refs] = {}
        self.unreduced: list[_Arena | _Refs] = []  # every batch holding values
        self.reduced: list[_Arena | _Refs] = []  # with a table, not yet read
        self.seen: dict[tuple, int] = {}  # elements (padded) copied per (device, dtype)
        self.bytes = 0  # what the unreduced batches hold (their held())
        # (value, its version when recorded, site): values of sites seen for the first time, copied,
        # whose versions say at the next reduction whose values can be kept by reference.
        self.watched: list[tuple] = []
        # While a compiled graph's record_batch kernel runs (lend() to give_back()): the batches
        # holding its values, and per device its statistics tensors and the arena that will hold them.
        self.lent: tuple[list, dict] | None = None

    def add_value(self, x: torch.Tensor, site: tuple, copy: bool = False) -> _Arena | _Refs:
        """Batch ``x``'s statistics (``x`` is the record's last row of the returned batch): kept by
        reference where its site is known to leave its values alone, else a copy of it is (see
        :data:`_SITES`); either way in its (device, dtype)'s one batch. ``copy``: always a copy
        (a compiled graph's buffer, which Inductor may reuse with no version bump), unless the
        graph lends it (:meth:`lend`): then kept by reference, and reduced before the loan ends."""
        if not x.numel():
            return self.add(x)[0]
        n = x.numel()
        if n * x.element_size() >= PENDING_BYTES // 8:
            # Reduced alone, now: no copy, no layout, and its float64 blocks are small (an embedding
            # matrix, logits over a vocabulary); a few fixed reductions a step for the largest values.
            with torch.no_grad():
                return self.add_table(matrix_stats(x.reshape(1, -1))[0])
        lent = self.lent
        inference = x.is_inference()
        # An inference tensor (made under torch.inference_mode) has no version counter: copied, unwatched.
        safe = True if lent is not None else False if inference or copy else _SITES.get(site)
        nbytes = _REF_FACTOR * (n + -n % PAD) * x.element_size()  # as _Refs.held() counts it
        watched = safe is None
        if watched:
            nbytes += n * x.element_size()  # the original, held until the next reduction
        if self.bytes and self.bytes + nbytes > PENDING_BYTES:
            self.reduce(everything=False)
        if not safe:
            if watched:
                self.watched.append((x, x._version, site))
            with torch.no_grad():  # one operator, where detach() and clone() are two
                x = x.clone()  # in the same batch as the values kept by reference: one reduction for all
        key = (x.device, x.dtype, True)
        refs = self.filling.get(key)
        if refs is None:
            refs = self.filling[key] = _Refs(x)
            self.unreduced.append(refs)
        # None: a copy made here, nobody else's, or a lent value, which nothing changes before the loan ends.
        refs.add(x, site, x._version if safe and lent is None else None)
        self.bytes += nbytes
        if lent is not None:
            lent[0].append(refs)
        return refs

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

    def add_graph_stats(self, stats: torch.Tensor) -> tuple[_Arena, int]:
        """Keep statistics a compiled graph computed on the device in a buffer it reuses once its op
        returns: a copy (one kernel), or, while the graph lends them (:meth:`lend`), one row of the
        table stacked when the loan ends (one kernel for all). Returns (arena, row)."""
        if self.lent is None:
            return self.add_table(stats.clone()), 0
        tables, arena = self.lent[1].setdefault(stats.device, ([], _Arena.of_table(None)))
        tables.append(stats)
        return arena, len(tables) - 1

    def lend(self) -> None:
        """A compiled graph's ``record_batch`` kernel starts: the values and statistics it hands over
        stay valid until :meth:`give_back`, so they are kept by reference, not copied."""
        self.lent = ([], {})

    def give_back(self) -> None:
        """The kernel returns: reduce the batches holding its values and stack its statistics (its
        buffers are reused from now on). No sync."""
        groups, stacks = self.lent
        self.lent = None
        for tables, arena in stacks.values():  # (one per device: a model split over GPUs)
            arena.table, arena.used = torch.stack(tables), len(tables)
            self.reduced.append(arena)
        if groups:  # (a reduction for the budget meanwhile may have taken some already)
            self._reduce_batches([a for a in self.unreduced if a in groups])

    def reduce(self, everything: bool = True) -> None:
        """Turn the arenas' copies into tables on their devices (no sync). Unless ``everything``, an
        arena holding under a sixteenth of :data:`PENDING_BYTES` keeps filling: a reduction's kernels
        are a fixed number per arena, and the few integer values a model records (token ids,
        positions) would pay them at every reduction of its float activations."""
        kept = [] if everything else [a for a in self.unreduced if a.held() < PENDING_BYTES // 16]
        if self.watched:
            # A site whose value nothing changed so far is kept by reference from now on. Usually at
            # a read, after the step; a reduction for the budget, inside a step, may learn before a
            # later operator changes one: that site's next record is lost (flagged), and copied since.
            for x, version, site in self.watched:
                if _SITES.get(site) is not False:
                    _SITES[site] = x._version == version
            self.watched = []
        self._reduce_batches([a for a in self.unreduced if a not in kept])

    def _reduce_batches(self, batches: list) -> None:
        """Reduce these unreduced batches (no sync); the others keep filling."""
        for arena in batches:
            arena.reduce()
            self.reduced.append(arena)
        self.unreduced = [a for a in self.unreduced if a not in batches]
        self.filling = {key: arena for key, arena in self.filling.items() if arena in self.unreduced}
        self.bytes = sum(a.held() for a in self.unreduced)

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
            lost = []
            for arena in arenas:
                arena.rows, start = rows[start : start + arena.used], start + arena.used
                arena.table = None
                for i, site in arena.lost:
                    arena.rows[i] = None
                    lost.append(" ".join(filter(None, site)))
            if lost:
                warnings.warn(f"picklehooks: {len(lost)} recorded value(s) were changed in place before their "
                              f"statistics were computed on the device ({', '.join(sorted(set(lost))[:5])}): "
                              "those records have no statistics (stats is None); these sites are copied when "
                              "recorded from now on", stacklevel=3)


# Elements (padded) recorded per (device, dtype) by the largest log so far, to size the next log's arenas.
_CAPACITY: dict[tuple, int] = {}


class _PendingRow(tuple):
    """``(pending, arena, i)``: where a batched record's statistics will be (see :class:`_Pending`).

    A type of its own, so that a record's source tells it from the plain tuple
    of values a hook computed, which is what nearly every record holds.
    """

    __slots__ = ()


def _read_pending(src: _PendingRow) -> list[float] | None:
    """The statistics of a batched record (``None`` for a value changed in place before its
    reduction); the first read of a log's brings all of its pending statistics to the host (one
    transfer per device)."""
    pending, arena, i = src
    if arena.rows is None:
        pending.read()
    return arena.rows[i]


# Records read from a log's rows are built by _speedups.build_records (csrc/records.c), which fills the
# slots of a new instance without calling __init__: keep __init__ the one dataclass writes. The builder
# checks the fields and __post_init__ (picklehooks._native.record_builder), and tests/runtime/test_record_builder.py
