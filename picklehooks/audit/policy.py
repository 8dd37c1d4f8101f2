"""The one trust policy: what a hook's text may import, and which globals a file may name.

Three readers share it:

* the shim, decoding a hook's name: the text may import only trusted
  packages (:data:`BASE_TRUSTED`, and ``trust=`` under :func:`untrusted`) or
  modules already imported. That part lives in :mod:`picklehooks._shim`
  itself, because the shim travels alone into torch.package archives and
  imports nothing else from picklehooks; this module re-exports it, so that
  every rule is read here;
* ``picklehooks.safe_globals`` (:mod:`picklehooks.audit.weights_only`): it decodes
  hooks :func:`untrusted`, imports a file's other globals only from trusted
  packages (:func:`import_trusted`), and refuses any global that could run
  code when ``torch.load`` calls it (:func:`dangerous`, :func:`dangerous_object`);
* ``picklehooks inspect`` (:mod:`picklehooks.audit`): a global is ``"ok"``
  only if ``torch.load(weights_only=True)`` allows it by default
  (:func:`allowed_globals`), a ``"hook"`` if it is one of ours, and
  ``"UNSAFE"`` otherwise (:func:`verdict`).

Limits: the deny list is a list: a global outside it is imported only from a
trusted package, but is then trusted to be what its name says.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import sys
import types
from typing import Any

from .._shim import BASE_TRUSTED, HUB_NAME, PicklehooksError, untrusted
from ._machine import PACKAGED_HOOK_LOADER

__all__ = ["BASE_TRUSTED", "untrusted", "DANGEROUS_MODULES", "SAFE_BUILTINS", "DANGEROUS_BUILTINS", "dangerous",
           "dangerous_object", "import_trusted", "allowed_globals", "verdict"]

#: Top-level modules none of whose functions or classes may be allowlisted:
#: each can run commands, touch files or the network, load code or unpickle.
DANGEROUS_MODULES = frozenset(
    """os posix nt posixpath ntpath subprocess sys importlib ctypes cffi pickle _pickle pickletools copyreg
    marshal shelve dbm shutil tempfile glob io _io zipimport pkgutil runpy code codeop pty platform
    multiprocessing asyncio threading _thread signal gc inspect types operator _operator functools
    socket ssl http urllib ftplib smtplib imaplib telnetlib xmlrpc webbrowser requests aiohttp httplib
    commands uuid venv ensurepip pip setuptools distutils bdb pdb doctest pydoc trace timeit profile
    cProfile idlelib lib2to3 test _osx_support _aix_support _pyrepl logging.FileHandler dill cloudpickle
    joblib numpy.f2py numpy.testing torch.serialization torch._dynamo torch._inductor torch.jit.unsupported_tensor_ops
    torch.fx.experimental.symbolic_shapes.ShapeEnv torch.utils._config_module torch.utils.bottleneck
    torch.utils.collect_env torch.utils.data.datapipes.utils.decoder""".split()
)
#: Builtins that may be allowlisted: plain data types. Every other builtin
#: (exec, eval, compile, open, getattr, setattr, __import__, vars, type ...) is refused.
SAFE_BUILTINS = frozenset(
    "int float complex bool str bytes bytearray tuple list dict set frozenset slice range".split()
)
DANGEROUS_BUILTINS = frozenset(n for n in dir(builtins) if n not in SAFE_BUILTINS)


def dangerous(dotted: str) -> bool:
    """True if the global ``dotted`` ("module.name") names something that can run arbitrary code."""
    parts = dotted.split(".")
    if parts[0] in ("builtins", "__builtin__"):
        return len(parts) != 2 or parts[1] not in SAFE_BUILTINS
    # Names that reach a dangerous module through another one (torch.serialization.os.system)
    # are caught once resolved, by _dangerous_object.
    return any(".".join(parts[:i]) in DANGEROUS_MODULES for i in range(1, len(parts) + 1))


def dangerous_object(obj: Any) -> bool:
    """True for a resolved global that is a module, a dangerous builtin, or lives in a dangerous module."""
    if isinstance(obj, types.ModuleType):
        return True
    if isinstance(obj, types.BuiltinFunctionType) and getattr(obj, "__self__", None) is builtins:
        return obj.__name__ not in SAFE_BUILTINS
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and dangerous(f"{module}.{getattr(obj, '__qualname__', '?')}")


def import_trusted(dotted: str, trusted: frozenset[str]) -> Any:
    """Resolve ``"pkg.mod.Name"`` by importing the longest importable module prefix of a trusted package."""
    parts = dotted.split(".")
    if parts[0] not in trusted and dotted.rpartition(".")[0] not in sys.modules:
        raise PicklehooksError(
            f"the checkpoint needs {dotted!r}; importing {parts[0]!r} would run its code, and it is not "
            f"trusted: if you trust it, pass trust=[{parts[0]!r}]"
        )
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise PicklehooksError(f"can't import {dotted!r}, which the checkpoint needs; install the package that defines it")


@functools.lru_cache(maxsize=1)
def allowed_globals() -> frozenset[str]:
    """``torch.load(weights_only=True)``'s default allowlist, as ``module.name`` strings."""
    from torch._weights_only_unpickler import _get_allowed_globals

    return frozenset(_get_allowed_globals())


def verdict(path: str, called: bool) -> str:
    """``"hook"``, ``"ok"`` (``weights_only``'s default allowlist) or ``"UNSAFE"``: what the audit says of a global."""
    head, _, rest = path.rpartition(".")
    if head == HUB_NAME and rest:
        return "hook"
    if path == PACKAGED_HOOK_LOADER and not called:  # only inside a packaged hook's persistent id
        return "hook"
    return "ok" if path in allowed_globals() else "UNSAFE"
