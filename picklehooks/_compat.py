"""The old import paths of public modules, kept for one release with a ``DeprecationWarning``.

``import picklehooks.log`` (or ``.codec``, ``.portable``, ``.package``,
``.instrument``, ``.tensorboard``, ``.mlflow``, ``.distributed``,
``.weights_only``) still gives the module, which now lives in a layer's
folder (:data:`MOVED`), and warns once per process. The alias is the moved
module itself, not a copy: pickles that name a class by its old path still
load. Nothing that saved files name moved (see the docs' wire-contract page).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: Old module path -> where it lives now.
MOVED = {
    "picklehooks.codec": "picklehooks.serialize.codec",
    "picklehooks.portable": "picklehooks.serialize.portable",
    "picklehooks.package": "picklehooks.serialize.package",
    "picklehooks.instrument": "picklehooks.capture.instrument",
    "picklehooks.log": "picklehooks.capture.log",
    "picklehooks.tensorboard": "picklehooks.integrations.tensorboard",
    "picklehooks.mlflow": "picklehooks.integrations.mlflow",
    "picklehooks.distributed": "picklehooks.integrations.distributed",
    "picklehooks.weights_only": "picklehooks.audit.weights_only",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path; loading it puts the moved module under the old name too."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):  # noqa: D102 - the default: a fresh module, replaced in exec_module
        return None

    def exec_module(self, module) -> None:  # noqa: D102
        # The import system returns what sys.modules holds under the name once this returns.
        _alias(module.__spec__.name)


def _caller_level() -> int:
    """The ``stacklevel`` of the line that used the old path: the first frame outside the import
    system (``importlib.import_module`` included), this module and ``picklehooks.__getattr__``.
    The warning then names the user's file, and shows where Python's default filters show a
    ``DeprecationWarning`` (code in ``__main__``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        internal = "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename
        if not internal:  # warnings.warn skips these frames itself when it counts stacklevel
            name = frame.f_globals.get("__name__") or ""
            if name not in (__name__, "picklehooks") and name.partition(".")[0] != "importlib":
                return level
            level += 1
        frame = frame.f_back
    return level


def _alias(old: str):
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; import it from there ({old} goes away in the next release)",
                  DeprecationWarning, stacklevel=_caller_level())
    moved = sys.modules[old] = importlib.import_module(new)
    return moved


def install() -> None:
    """Add the finder to ``sys.meta_path`` once (``import picklehooks`` does)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def moved_attribute(name: str):
    """``picklehooks.<name>`` for an old module name not imported yet: the moved module, with the warning."""
    old = f"picklehooks.{name}"
    if old not in MOVED:
        raise AttributeError(f"module 'picklehooks' has no attribute {name!r}")
    moved = sys.modules.get(old) or _alias(old)
    setattr(sys.modules["picklehooks"], name, moved)
    return moved
