"""The shim: turn a hook's encoded *name* back into the hook.

Pickle stores a function as ``module`` + ``name``. picklehooks stores each hook
as ``picklehooks._hub.<name>``, where ``<name>`` is the hook's zstd-compressed,
base32-encoded source (see :mod:`picklehooks.codec`). ``picklehooks._hub`` is
a virtual module: a :data:`sys.meta_path` finder in this file creates it, and
its PEP 562 ``__getattr__`` decodes a name, checks the decoded text, compiles
it, executes it and caches the resulting function on the module, so that the
next lookup (and pickle's "is it the same object?" check) finds the same
object.

The hub's loader has ``get_source``, which returns the text of every hook
decoded so far, one block after another. Each hook is compiled at its own
line offset inside that text, under the hub's file name, so tracebacks,
``inspect.getsource`` and TorchScript all read the hook's own lines, even
after :func:`linecache.clearcache` (``linecache.lazycache`` asks the loader
again). This is the technique of ``torch/fx/graph_module.py``'s
``_EvalCacheLoader``, with one module instead of one file per piece of code,
because ``linecache.lazycache`` only hands the loader a module name.

This file imports only the standard library and the zstd decompressor
(``zstandard``, or ``compression.zstd`` on Python 3.14+), never torch and
never the rest of picklehooks, so that it can travel alone inside a
``torch.package`` archive.

Limits:

* Decoding is bounded: a name's declared and actual decompressed size may not
  exceed :data:`MAX_SOURCE_BYTES` (1 MiB unless changed with
  :func:`set_max_source_bytes`), and the decoded text must have the shape
  picklehooks generates (imports, constant assignments, exactly one
  undecorated ``def``), so executing it can only define the function.
* Executing a hook's text imports the modules it names. Loading a pickle runs
  code; so does resolving a hook name. Only load files you trust, and audit
  them first with ``python -m picklehooks inspect FILE``.
"""

from __future__ import annotations

import ast
import base64
import binascii
import builtins
import functools
import importlib
import importlib.abc
import importlib.machinery
import linecache
import threading
import types

# torch.package won't implicitly extern `sys` from packaged code, and a user
# who already declared their patterns can't be asked to; importlib reaches
# the host's module without the exporter's dependency scan noticing.
sys = importlib.import_module("sys")


def _import_decompressor():
    """Return (zstandard, compression.zstd), either possibly None.

    ``importlib.import_module`` rather than ``import``: inside a torch.package
    archive it reaches the host's installed decompressor directly, and the
    exporter's dependency scan doesn't try to package a C extension.
    """
    found = []
    for name in ("zstandard", "compression.zstd"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            found.append(None)
    if found == [None, None]:  # pragma: no cover - a broken install
        raise ImportError("picklehooks needs the 'zstandard' package (or Python 3.14+): pip install zstandard")
    return found


_zstandard, _stdlib_zstd = _import_decompressor()


class PicklehooksError(Exception):
    """Base class of every error picklehooks raises on purpose."""


class DecodeError(PicklehooksError, AttributeError):
    """A hook name could not be decoded into a hook.

    It is also an :class:`AttributeError`, because ``getattr`` and pickle
    treat a missing module attribute that way.
    """


HUB_NAME = "picklehooks._hub"
HUB_FILENAME = "<picklehooks-generated>/_hub.py"

#: Default bound on the decoded size of one hook, in bytes of UTF-8 source.
MAX_SOURCE_BYTES = 1 << 20

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_B32_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567")

# A raw-content zstd dictionary: text that hook sources tend to share. zstd
# uses it as a history window that every name may refer back to, so common
# idioms cost a few bits instead of their length. It is part of the format:
# never edit it; add a new format letter with a new dictionary instead.
# bench/bench_serializer.py measures what it saves.
_DICTIONARY_1 = """\
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from typing import Any, Dict, List, Optional, Tuple
def forward_hook(module, inputs, output):
def forward_pre_hook(module, inputs):
def hook(module: torch.nn.Module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
def pre_hook(module: torch.nn.Module, inputs: Tuple[torch.Tensor]) -> Tuple[torch.Tensor]:
    return output
    return inputs
    return (x,)
    x = inputs[0]
    if not torch.isfinite(output).all():
        raise RuntimeError(f"non-finite output in {module.__class__.__name__}")
    print(module.__class__.__name__, output.shape, output.mean().item(), output.std().item())
    output.detach().abs().max()
    return torch.clamp(output, min=-1.0, max=1.0)
    return output * scale
    torch.nan_to_num(output)
    output.register_hook(lambda grad: grad.clamp(-clip, clip))
"""

# Format letter -> zstd dictionary text (None: no dictionary). The letter is
# the first character of every name; old letters must stay decodable forever.
FORMATS: dict[str, str | None] = {"a": _DICTIONARY_1}
CURRENT_FORMAT = "a"

_max_source_bytes = MAX_SOURCE_BYTES


def set_max_source_bytes(limit: int) -> int:
    """Set the default bound on a decoded hook's size; return the old bound."""
    global _max_source_bytes
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ValueError(f"max_source_bytes must be a positive int, got {limit!r}")
    old, _max_source_bytes = _max_source_bytes, limit
    return old


def _frame_content_size(frame: bytes, name: str) -> int:
    """Read the declared size from a zstd frame header (RFC 8878, 3.1.1.1).

    picklehooks always writes single-segment frames with a content size and a
    checksum and without a dictionary id; anything else is not ours.
    """
    if len(frame) < 2:
        raise DecodeError(f"hook name {_short(name)!r} is truncated: its zstd frame has no header")
    descriptor = frame[0]
    size_flag, single_segment = descriptor >> 6, (descriptor >> 5) & 1
    reserved, checksum, dict_id_flag = (descriptor >> 3) & 1, (descriptor >> 2) & 1, descriptor & 3
    if reserved or not single_segment or not checksum or dict_id_flag:
        raise DecodeError(
            f"hook name {_short(name)!r} is not a picklehooks name: its zstd frame header "
            f"(descriptor 0x{descriptor:02x}) is not the single-segment, checksummed form picklehooks writes"
        )
    width = (1, 2, 4, 8)[size_flag]
    if len(frame) < 1 + width:
        raise DecodeError(f"hook name {_short(name)!r} is truncated inside its zstd frame header")
    size = int.from_bytes(frame[1 : 1 + width], "little")
    return size + 256 if width == 2 else size


@functools.lru_cache(maxsize=None)
def _zstd_dict(letter: str):
    dictionary = FORMATS[letter]
    if dictionary is None:
        return None
    if _zstandard is not None:
        return _zstandard.ZstdCompressionDict(dictionary.encode(), dict_type=_zstandard.DICT_TYPE_RAWCONTENT)
    return _stdlib_zstd.ZstdDict(dictionary.encode(), is_raw=True)  # pragma: no cover


def _decompress(frame: bytes, letter: str, size: int) -> bytes:
    data = _ZSTD_MAGIC + frame
    if _zstandard is not None:
        return _zstandard.ZstdDecompressor(dict_data=_zstd_dict(letter)).decompress(data, max_output_size=size)
    decompressor = _stdlib_zstd.ZstdDecompressor(zstd_dict=_zstd_dict(letter))  # pragma: no cover
    return decompressor.decompress(data, max_length=size)  # pragma: no cover


def _short(name: str) -> str:
    return name if len(name) <= 24 else name[:20] + "..."


def decode(name: str, *, max_source_bytes: int | None = None) -> str:
    """Return the source text that ``name`` encodes.

    Raises :class:`DecodeError` for a name that is malformed, truncated,
    mutated, made by an unknown format, or that decodes to more than
    ``max_source_bytes`` (default: :data:`MAX_SOURCE_BYTES`).
    """
    if not isinstance(name, str):
        raise DecodeError(f"a hook name must be a str, got {type(name).__name__} {name!r}")
    limit = _max_source_bytes if max_source_bytes is None else max_source_bytes
    if not name:
        raise DecodeError("a hook name must not be empty")
    letter, payload = name[0], name[1:]
    if letter not in FORMATS:
        raise DecodeError(
            f"hook name {_short(name)!r} starts with {letter!r}, which is not a picklehooks format "
            f"letter (known: {', '.join(sorted(FORMATS))}); it is foreign, or needs a newer picklehooks"
        )
    # A compressed hook is never larger than a few times its source; refusing
    # absurd names up front keeps base32 decoding itself bounded.
    if len(payload) > 2 * limit + 64:
        raise DecodeError(f"hook name of {len(name)} characters exceeds the bound for {limit} bytes of source")
    if len(payload) % 8 or not payload:
        raise DecodeError(
            f"hook name {_short(name)!r} is truncated or malformed: its payload has {len(payload)} "
            "characters, not a positive multiple of 8"
        )
    bad = set(payload) - _B32_ALPHABET - {"_"}
    if bad:
        raise DecodeError(f"hook name {_short(name)!r} contains {''.join(sorted(bad))!r}, outside base32 and '_'")
    try:
        frame = base64.b32decode(payload.replace("_", "="))
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"hook name {_short(name)!r} is not valid base32: {exc}") from None
    size = _frame_content_size(frame, name)
    if size > limit:
        raise DecodeError(
            f"hook name {_short(name)!r} declares {size} bytes of source, over the limit of {limit}; "
            "raise it with picklehooks.codec.set_max_source_bytes() if you trust this file"
        )
    try:
        raw = _decompress(frame, letter, size)
    except Exception as exc:  # zstd reports corruption with its own error types
        raise DecodeError(f"hook name {_short(name)!r} is corrupt: zstd says {exc}") from None
    if len(raw) != size:
        raise DecodeError(f"hook name {_short(name)!r} is corrupt: {len(raw)} bytes decoded, {size} declared")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"hook name {_short(name)!r} does not decode to UTF-8 text: {exc}") from None


# --------------------------------------------------------------------------
# Checking the decoded text: only the shape picklehooks generates may run.

_SAFE_CALLS = {("float",), ("torch", "device"), ("torch", "dtype")}


def _dotted(node: ast.AST) -> tuple[str, ...] | None:
    if isinstance(node, ast.Name):
        return (node.id,)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else (*base, node.attr)
    return None


def _is_safe_expr(node: ast.AST | None) -> bool:
    """True for literals, names, attributes and subscripts (annotations and
    defaults), and a few constructor calls with literal arguments."""
    if node is None or isinstance(node, (ast.Constant, ast.Name)):
        return True
    if isinstance(node, ast.Attribute):
        return _is_safe_expr(node.value)
    if isinstance(node, ast.Subscript):
        return _is_safe_expr(node.value) and _is_safe_expr(node.slice)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_safe_expr(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(_is_safe_expr(k) and _is_safe_expr(v) for k, v in zip(node.keys, node.values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_safe_expr(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # `X | None` annotations
        return _is_safe_expr(node.left) and _is_safe_expr(node.right)
    if isinstance(node, ast.Call):
        return (
            _dotted(node.func) in _SAFE_CALLS
            and not node.keywords
            and all(isinstance(a, ast.Constant) for a in node.args)
        )
    return False


def _check_shape(tree: ast.Module, name: str) -> str:
    """Check that ``tree`` is imports, constants and one ``def``; return the def's name."""
    defs = []
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef):
            args = stmt.args
            annotated = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            evaluated = [a.annotation for a in annotated if a is not None]
            evaluated += [*args.defaults, *args.kw_defaults, stmt.returns]
            if stmt.decorator_list or not all(_is_safe_expr(e) for e in evaluated):
                raise DecodeError(f"hook {_short(name)!r}: its def has decorators or computed defaults/annotations")
            defs.append(stmt.name)
        elif isinstance(stmt, ast.Import) or (
            isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and all(a.name != "*" for a in stmt.names)
        ):
            continue
        elif (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and _is_safe_expr(stmt.value)
        ):
            continue
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring or comment-like string
        else:
            raise DecodeError(
                f"hook {_short(name)!r} decodes to a {type(stmt).__name__} statement at line {stmt.lineno}; "
                "hook text may only hold imports, constant assignments and one def"
            )
    if len(defs) != 1:
        raise DecodeError(f"hook {_short(name)!r} decodes to {len(defs)} function definitions, not exactly one")
    return defs[0]


# --------------------------------------------------------------------------
# The hub: a module whose attributes are decoded hooks.


class _HubLoader(importlib.abc.Loader):
    """Loader (and ``get_source`` provider) for one hub module.

    The same object is the hub's ``__loader__`` and the loader that
    ``linecache.lazycache`` finds through each hook's globals, so every
    reader sees the same text. There is one hub per process (``picklehooks._hub``)
    plus one per loaded torch.package archive, each with its own file name,
    so their ``linecache`` entries never collide.
    """

    def __init__(self, module_name: str, filename: str) -> None:
        self.module_name = module_name
        self.filename = filename
        self._lines: list[str] = ["# Hooks that picklehooks decoded from function names, in decoding order.\n"]
        self._lock = threading.RLock()
        self._namespace: dict | None = None

    # -- importlib protocol -------------------------------------------------
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object is what we want

    def exec_module(self, module: types.ModuleType) -> None:
        module.__file__ = self.filename
        self.bind(module.__dict__)

    def get_source(self, fullname: str) -> str | None:
        # The hub and each hook's own globals module ("<hub>.<name>") share one text.
        if fullname != self.module_name and not fullname.startswith(self.module_name + "."):
            return None
        with self._lock:
            return "".join(self._lines)

    def is_package(self, fullname: str) -> bool:
        return False

    # -- the hub ------------------------------------------------------------
    def bind(self, namespace: dict) -> None:
        """Make the module whose globals are ``namespace`` resolve hook names on demand."""
        namespace["__getattr__"] = self._module_getattr
        self._namespace = namespace

    def _module_getattr(self, name: str) -> types.FunctionType:
        if name.startswith("__") or self._namespace is None:
            raise AttributeError(f"module {self.module_name!r} has no attribute {name!r}")
        return self.resolve(name)

    def resolve(self, name: str) -> types.FunctionType:
        """Return the hook that ``name`` encodes, decoding it at most once."""
        namespace = self._namespace
        with self._lock:  # concurrent first lookups must agree on one object
            cached = namespace.get(name)
            if cached is not None:
                return cached
            fn = self._define(name, decode(name))
            namespace[name] = fn
            return fn

    def _define(self, name: str, source: str) -> types.FunctionType:
        try:
            tree = ast.parse(source, self.filename)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            raise DecodeError(f"hook {_short(name)!r} decodes to text that is not Python: {exc}") from None
        def_name = _check_shape(tree, name)
        if not source.endswith("\n"):
            source += "\n"
        ast.increment_lineno(tree, len(self._lines))
        code = compile(tree, self.filename, "exec", dont_inherit=True)
        # Each hook gets its own globals (hooks' constants must not collide),
        # which are the dict of a real module named "<hub>.<name>": torch.compile
        # guards a global by importing f_globals["__name__"] and reading it there.
        hook_module = types.ModuleType(f"{self.module_name}.{name}")
        namespace = hook_module.__dict__
        namespace.update(
            __file__=self.filename,
            __loader__=self,
            __spec__=None,  # so linecache asks __loader__, which is this object
            # Inside a torch.package archive these are the archive's builtins, so
            # the hook's imports resolve through the archive like any packaged code.
            __builtins__=self._namespace.get("__builtins__", builtins),
        )
        exec(code, namespace)
        sys.modules.setdefault(hook_module.__name__, hook_module)
        fn = namespace[def_name]
        fn.__name__ = fn.__qualname__ = name
        fn.__module__ = self.module_name
        fn.__reduce_package__ = functools.partial(_reduce_package, name)
        self._lines.extend(source.splitlines(keepends=True))
        self._lines.append("\n")
        # Refresh linecache: drop a realised (now stale) entry, leave a lazy one.
        linecache.cache.pop(self.filename, None)
        linecache.lazycache(self.filename, namespace)
        return fn


class _HubFinder(importlib.abc.MetaPathFinder):
    """Makes the hub importable by its stable name, for importlib, pickle and torch.package."""

    def __init__(self, loader: _HubLoader) -> None:
        self.loader = loader

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        if fullname != self.loader.module_name:
            return None
        return importlib.machinery.ModuleSpec(fullname, self.loader, origin=self.loader.filename)


HUB_LOADER = _HubLoader(HUB_NAME, HUB_FILENAME)


def install() -> None:
    """Put the hub finder on :data:`sys.meta_path` once per process."""
    if not any(isinstance(f, _HubFinder) and f.loader is HUB_LOADER for f in sys.meta_path):
        sys.meta_path.insert(0, _HubFinder(HUB_LOADER))


def hub() -> types.ModuleType:
    """Return the hub module, importing it if needed."""
    install()
    module = sys.modules.get(HUB_NAME)
    return module if module is not None else importlib.import_module(HUB_NAME)


# --------------------------------------------------------------------------
# torch.package: the archive carries this file and a stub hub, so a host
# without picklehooks can load it. Exporters find ``__reduce_package__`` on
# every hook (set in ``_define``) and call it; nothing here imports torch.

SHIM_NAME = "picklehooks._shim"

#: The hub's text inside an archive; `_make_package_hub` does the work.
PACKAGE_HUB_SOURCE = f"""\
\"\"\"Hooks decoded inside this torch.package archive; see picklehooks/_shim.py.\"\"\"
from {SHIM_NAME} import _make_package_hub

_make_package_hub(globals())
"""


def _make_package_hub(namespace: dict) -> None:
    """Turn an archive's ``picklehooks._hub`` into a hub with its own loader and file name."""
    name = namespace["__name__"]  # mangled per importer, e.g. "<torch_package_0>.picklehooks._hub"
    _HubLoader(name, f"<picklehooks-generated>/{name}.py").bind(namespace)


def prepare_exporter(exporter) -> None:
    """Add the shim and the stub hub to a ``torch.package.PackageExporter`` (once)."""
    if getattr(exporter, "_picklehooks_prepared", False):
        return
    own_source = __loader__.get_source(__name__)  # our file on a host, our record in an archive
    if not own_source:  # pragma: no cover - a shim loaded without a source-providing loader
        raise PicklehooksError(f"can't read the source of {__name__} to put it in the package")
    exporter.save_source_string(SHIM_NAME, own_source)
    exporter.save_source_string(HUB_NAME, PACKAGE_HUB_SOURCE)
    exporter._picklehooks_prepared = True


def _hook_imports(source: str) -> list[str]:
    tree = ast.parse(source)
    names = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            names += [a.name for a in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            names.append(stmt.module)
    return names


_PACKAGE = SHIM_NAME.rpartition(".")[0]


def _own_imports(source: str, module_name: str) -> list[str]:
    """The modules of our own package that ``source`` (module ``module_name``) imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = module_name.rsplit(".", node.level)[0]
            found += [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
    return [m for m in found if m.startswith(_PACKAGE + ".")]


def _package_own_module(exporter, module_name: str) -> None:
    """Copy one of our modules (e.g. the logging runtime a generated hook imports) into the archive.

    Its own imports from this package go first, so that the exporter's scan
    finds them already provided instead of asking the user's patterns; the
    copies defer to the host's picklehooks where one is installed.
    """
    node = exporter.dependency_graph.nodes.get(module_name, {})
    if node.get("provided") or node.get("picklehooks_visiting"):
        return
    exporter.dependency_graph.add_node(module_name, picklehooks_visiting=True)
    module = exporter.importer.import_module(module_name)
    source = module.__loader__.get_source(module.__name__)
    for dep in _own_imports(source, module_name):
        _package_own_module(exporter, dep)
    exporter.save_source_string(module_name, source)


def _reduce_package(name: str, exporter) -> tuple:
    """``__reduce_package__`` of every hook: package the shim and the hook's imports."""
    prepare_exporter(exporter)
    source = decode(name)
    for module in _hook_imports(source):
        if module.startswith(_PACKAGE + "."):
            _package_own_module(exporter, module)
            continue
        # The imports hide inside the name, where the exporter's scan can't see them.
        exporter.add_dependency(module)
        node = exporter.dependency_graph.nodes.get(module, {})
        if node.get("error") is not None:
            def_name = _check_shape(ast.parse(source), name)
            raise PicklehooksError(
                f"hook {def_name!r} imports {module!r}, which this PackageExporter has no rule for "
                f"({node['error'].value}); declare it first, e.g. exporter.extern({module!r}) or "
                f"exporter.intern({module!r})"
            )
    return _load_packaged_hook, (name,)


def _load_packaged_hook(importer, name: str) -> types.FunctionType:
    """Inverse of :func:`_reduce_package`, run by ``PackageImporter`` on load."""
    return getattr(importer.import_module(HUB_NAME), name)


# Only the real, top-level copy registers itself: a copy loaded from inside a
# torch.package archive has a mangled name and must not touch the host's
# import system.
if __name__ == SHIM_NAME:
    install()
