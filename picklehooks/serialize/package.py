"""Ship hooked models through ``torch.package`` to hosts without picklehooks.

Every portable hook carries a ``__reduce_package__`` (see
:mod:`picklehooks._shim`), so any ``PackageExporter`` that pickles one also
writes, once per archive:

* ``picklehooks/_shim.py``: the shim, verbatim (standard library + zstd only);
* ``picklehooks/_hub.py``: a three-line stub that makes the archive's own hub;
* a dependency on every module the hook's text imports, which the exporter
  could not otherwise see, because the imports hide inside the hook's name.

The loading host needs only torch and the zstd decompressor (``zstandard``,
or Python 3.14+). Each ``PackageImporter`` gets its own hub, so loading an
archive twice, or on a host that has picklehooks installed, never mixes
functions or ``linecache`` entries.

Limits: hooks loaded from an archive show their source through ``linecache``
until ``linecache.clearcache()`` (as all packaged code does); a hook that
imports a module the exporter has no rule for raises
:class:`~picklehooks.PicklehooksError` naming the hook and the module.

>>> import picklehooks.serialize.package, torch
>>> picklehooks.serialize.package.save("/tmp/model.pt", torch.nn.Linear(2, 2))
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from torch.package import PackageExporter

from .._shim import prepare_exporter

__all__ = ["save", "prepare"]


def prepare(exporter: PackageExporter) -> PackageExporter:
    """Add picklehooks' shim to ``exporter`` (idempotent); return the exporter.

    Optional, since pickling a portable hook does it too, but harmless before
    or after the exporter's own ``intern``/``extern``/``mock`` declarations::

        with PackageExporter(path) as pe:
            picklehooks.serialize.package.prepare(pe)
            pe.save_pickle("model", "model.pkl", model)
    """
    if not isinstance(exporter, PackageExporter):
        raise TypeError(f"prepare() takes a torch.package.PackageExporter, got {exporter!r:.80}")
    prepare_exporter(exporter)
    return exporter


def save(
    path: str | os.PathLike,
    obj: Any,
    *,
    package: str = "model",
    resource: str = "model.pkl",
    intern: Iterable[str] = ("**",),
    extern: Iterable[str] = (),
    mock: Iterable[str] = (),
) -> None:
    """Export ``obj`` (e.g. a hooked model) to a torch.package archive at ``path``.

    Load it anywhere with ``PackageImporter(path).load_pickle(package, resource)``.
    ``intern``/``extern``/``mock`` are the exporter's patterns; by default every
    module that isn't torch or the standard library is interned (copied in).
    """
    with PackageExporter(path) as exporter:
        prepare(exporter)
        extern, mock = list(extern), list(mock)
        if extern:
            exporter.extern(extern)
        if mock:
            exporter.mock(mock)
        exporter.intern(list(intern), exclude=extern + mock)
        exporter.save_pickle(package, resource, obj)
