"""``Record``: one recorded value, as the log's reading side hands it out.

Records are built lazily from the compact rows the hooks add
(:mod:`picklehooks.capture.rows`); a record's statistics are read from its
batch (:mod:`picklehooks.capture.pending`) the first time they are asked for.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import torch

from .. import _stats
from .pending import _PendingRow, _read_pending

__all__ = ["Record", "STAT_NAMES", "RENAMED_STATS"]

#: Old statistic names -> their names now (issue #28). ``nan`` and ``inf`` read as pandas' float
#: constants in ``DataFrame.query("nan > 0")``, so the counts became ``n_nan`` and ``n_inf``.
#: Only the reading side was renamed: the kernels of the pinned runtime still compute the values in
#: the order of :data:`picklehooks._stats.STAT_NAMES`, under its old names (the wire contract).
RENAMED_STATS = {"nan": "n_nan", "inf": "n_inf"}
#: The statistics of a record, in the order the kernels compute them (position ``i`` here is
#: position ``i`` of :data:`picklehooks._stats.STAT_NAMES`): keys of ``Record.stats``, columns
#: of ``Log.table()``, ``to_pandas()``, ``records.json`` and sinks.
STAT_NAMES = tuple(RENAMED_STATS.get(name, name) for name in _stats.STAT_NAMES)

_COUNTS = ("n_nan", "n_inf")


class Stats(dict):
    """``Record.stats``: a plain dict, except that an old statistic name (:data:`RENAMED_STATS`)
    still finds its value, with a ``DeprecationWarning`` naming the new one; iterating, ``in`` and
    equality see the new names only."""

    __slots__ = ()

    def __missing__(self, key):
        new = RENAMED_STATS.get(key) if isinstance(key, str) else None
        if new is None or not dict.__contains__(self, new):
            raise KeyError(key)
        _warn_renamed(key, new)
        return dict.__getitem__(self, new)

    def get(self, key, default=None):
        new = RENAMED_STATS.get(key) if isinstance(key, str) and not dict.__contains__(self, key) else None
        if new is not None and dict.__contains__(self, new):
            _warn_renamed(key, new)
            return dict.__getitem__(self, new)
        return dict.get(self, key, default)

    # Pickled as an OrderedDict, which torch.load(weights_only=True) accepts, as it did the plain
    # dict stats were before; copies stay Stats (the values are numbers, strings and tuples).
    def __reduce__(self):
        return collections.OrderedDict, (list(self.items()),)

    def __copy__(self) -> Stats:
        return Stats(self)

    def __deepcopy__(self, memo) -> Stats:
        return Stats(self)


def _warn_renamed(old: str, new: str) -> None:
    warnings.warn(f"the statistic {old!r} is now called {new!r}: read stats[{new!r}] (the old name "
                  "goes away in the next release)", DeprecationWarning, stacklevel=3)


def _renamed(row: dict) -> dict:
    """``row`` with its statistics under the names of :data:`STAT_NAMES`: a row an older picklehooks
    wrote (``nan``, ``inf``) is copied with those keys renamed; a current one is returned as it is."""
    if not any(old in row for old in RENAMED_STATS):
        return row
    return {(RENAMED_STATS[k] if k in RENAMED_STATS and RENAMED_STATS[k] not in row else k): v
            for k, v in row.items()}


if STAT_NAMES != ("mean", "std", "min", "max", "absmax", "norm", "n_nan", "n_inf", "zero_frac"):
    raise RuntimeError(f"_stats_dict unpacks the statistics by position; update it for {STAT_NAMES}")


def _stats_dict(shape: tuple, dtype: str, values) -> dict:
    # Unpacked and passed by keyword: about half the time of update(zip(...)), on a path that runs
    # once per record read (a tenth of a tiny model's recording overhead was these dicts).
    mean, std, lo, hi, absmax, norm, nan, inf, zero_frac = values
    return Stats(shape=shape, dtype=dtype, mean=mean, std=std, min=lo, max=hi, absmax=absmax, norm=norm,
                 n_nan=int(nan), n_inf=int(inf), zero_frac=zero_frac)



class _ZerosIfNone:
    """A record's source of statistics (a row's values or :class:`_PendingRow`) for a gradient that a
    ``torch.compile`` backward computed: all zeros there may stand for no gradient at all (see
    :data:`picklehooks._ops.COMPILED`), so such a record gets no statistics and a :attr:`Record.note`."""

    __slots__ = ("src", "site")

    def __init__(self, src, site: tuple[str, str, str]) -> None:
        self.src, self.site = src, site


class _NoGradient:
    """The type of :data:`_NO_GRADIENT`: one object, which pickles and copies as itself."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "_NO_GRADIENT"


#: What :func:`_resolve` gives, and a read record keeps in ``_src``, for an all-zero compiled gradient.
_NO_GRADIENT = _NoGradient()
NO_GRADIENT_NOTE = ("torch.compile gives a compiled backward zeros where the caller gave a graph output no "
                    "gradient, so this all-zero gradient may be no gradient at all (eager mode records none then)")


def _resolve(src):
    """The statistics values of a record's source (``None``: changed in place before its reduction;
    :data:`_NO_GRADIENT`: a compiled gradient of all zeros, which may be none)."""
    if type(src) is _PendingRow:
        return _read_pending(src)
    if type(src) is not _ZerosIfNone:
        return src
    values = _resolve(src.src)
    # zero_frac is 1 only for a non-empty value of zeros (NaN counts as no zero).
    if values is not None and values[STAT_NAMES.index("zero_frac")] == 1.0:
        module, kind, path = src.site
        warnings.warn(f"{module or '<root>'} {kind} (path {path!r}) is all zeros in a torch.compile graph, "
                      "where it may stand for no gradient at all: its stats are None (Record.note says why)",
                      RuntimeWarning, stacklevel=3)
        return _NO_GRADIENT
    return values


@dataclasses.dataclass(eq=False, slots=True, weakref_slot=True)  # slots: built per record when read
class Record:
    """One recorded value.

    ``module`` is the qualified name (``""`` for the root), ``kind`` one of
    ``input output grad_input grad_output param buffer param_grad``,
    ``path`` the position inside a nested value (``""``, ``"0"``,
    ``"logits"``, ``"0/1"``), ``call`` which call of the module in this
    log, ``step`` the log's step when recorded. ``source``: where that call
    came from, the line of code that called the module, then the module's
    class and where it is defined:
    ``"transformers/models/gpt2/modeling_gpt2.py:412 in GPT2MLP.forward
    (NewGELUActivation, transformers/activations.py:56)"`` (see
    :mod:`picklehooks.capture.sources`); ``None`` where it isn't known.
    """

    module: str
    kind: str
    path: str
    call: int
    step: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    tensor: torch.Tensor | None = None
    value: str | None = None  # repr of a non-tensor value
    live: torch.Tensor | None = dataclasses.field(default=None, repr=False)  # record(keep_graph=True)
    rank: int | None = None
    _stats: dict | None = dataclasses.field(default=None, repr=False)
    # Until read: the values computed in the hook, or a batched statistic's _PendingRow.
    _src: tuple | None = dataclasses.field(default=None, repr=False)
    source: str | None = None

    @property
    def stats(self) -> dict | None:
        """``shape, dtype`` and :data:`STAT_NAMES`; ``None`` for non-tensor values or ``mode="tensor"``.

        The first read brings every pending statistic of the log to the host at once.
        """
        if self._stats is None and self._src is not None and self._src is not _NO_GRADIENT:
            values = _resolve(self._src)
            if values is _NO_GRADIENT:
                self._src = values  # (note reads it)
                return None
            # None: the value was changed in place before its batch was reduced (lost, and warned).
            self._stats, self._src = None if values is None else _stats_dict(self.shape, self.dtype, values), None
        return self._stats

    @property
    def note(self) -> str | None:
        """Why this record has no statistics though its value was recorded, or ``None``.

        Set for a gradient a ``torch.compile`` backward computed as all zeros where it may be
        no gradient at all (:data:`NO_GRADIENT_NOTE`). Tables, log files and sinks keep it (a
        ``note`` column); a loaded note reads as this one, the only one there is.
        """
        if type(self._src) is _ZerosIfNone:
            self.stats  # noqa: B018 - resolves it
        return NO_GRADIENT_NOTE if self._src is _NO_GRADIENT else None

    @property
    def key(self) -> tuple[str, str, str, int]:
        """``(module, kind, path, call)``: what identifies a record across runs and backends."""
        return (self.module, self.kind, self.path, self.call)

    def row(self) -> dict:
        """This record as a flat dict (one row of :meth:`Log.table`)."""
        row = {
            "module": self.module,
            "kind": self.kind,
            "path": self.path,
            "call": self.call,
            "step": self.step,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
            "value": self.value,
            "source": self.source,
            "note": self.note,
        }
        if self.rank is not None:
            row["rank"] = self.rank
        stats = self.stats or {}
        row.update({name: stats.get(name) for name in STAT_NAMES})
        return row


def _record_from_row(row: dict, tensor: torch.Tensor | None) -> Record:
    shape = tuple(row["shape"]) if row["shape"] is not None else None
    rec = Record(row["module"], row["kind"], row["path"], row["call"], row["step"], shape=shape,
                 dtype=row["dtype"], value=row["value"], rank=row.get("rank"), tensor=tensor,
                 source=row.get("source"))
    if row.get("note") is not None:  # (since log format 5 and sink format 4) the one note there is
        rec._src = _NO_GRADIENT
        return rec
    row = _renamed(row)  # a row of an older picklehooks: nan, inf
    if row.get("mean") is not None or row.get("n_nan") is not None:
        rec._stats = Stats(shape=shape, dtype=row["dtype"])
        rec._stats.update((n, row[n]) for n in STAT_NAMES)
    return rec

