"""The shim: turn a hook's encoded *name* back into the hook.

Pickle stores a function as ``module`` + ``name``. picklehooks stores each hook
as ``picklehooks._hub.<name>``, where ``<name>`` is the hook's zstd-compressed,
base32-encoded source (see :mod:`picklehooks.serialize.codec`). ``picklehooks._hub`` is
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
  :func:`set_max_source_bytes`), one process decodes at most
  :data:`MAX_TOTAL_SOURCE_BYTES` in all, and a name must be the canonical
  base32 of exactly one zstd frame (so one text has one name).
* Executing a hook's text can only import and define: :class:`_Checker`
  tracks every binding and refuses calls, operators, subscripts and attribute
  reads that could run code while the ``def`` is evaluated. Its imports follow
  a policy: :data:`BASE_TRUSTED` packages or modules already imported (by
  default), :data:`BASE_TRUSTED` and ``trust=`` only (inside
  :func:`untrusted`); never ``__main__`` modules or the hub itself. Importing
  a module still runs that module's code, and the hook's *body* runs when the
  hook is called. Loading a pickle runs whatever else the pickle says; audit
  files with ``python -m picklehooks inspect FILE``.
* Inside a torch.package archive the hook's imports go through the archive's
  importer (the archive is code anyway); only the text checks apply there.
"""

from __future__ import annotations

import ast
import base64
import binascii
import builtins
import contextlib
import contextvars
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


def _decompress(frame: bytes, letter: str, size: int) -> tuple[bytes, bytes]:
    """Decompress one frame whose header declared ``size``; return (content, bytes after the frame)."""
    data = _ZSTD_MAGIC + frame
    if _zstandard is not None:
        decompressor = _zstandard.ZstdDecompressor(dict_data=_zstd_dict(letter))
        # One-shot first: bounded by the declared size (it fails on more).
        raw = decompressor.decompress(data, max_output_size=size)
        stream = decompressor.decompressobj()  # then again, to see where the frame ends
        stream.decompress(data)
        return raw, stream.unused_data
    decompressor = _stdlib_zstd.ZstdDecompressor(zstd_dict=_zstd_dict(letter))  # pragma: no cover
    return decompressor.decompress(data, max_length=size), decompressor.unused_data  # pragma: no cover


def _short(name: str, width: int = 24) -> str:
    return name if len(name) <= width else name[: width - 4] + "..."


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
    # base32 ignores the unused low bits of a padded last character, so one
    # frame would have several names (and several function objects).
    if base64.b32encode(frame).decode("ascii") != payload.replace("_", "="):
        raise DecodeError(f"hook name {_short(name)!r} is not in canonical base32 (its unused bits are set)")
    size = _frame_content_size(frame, name)
    if size > limit:
        raise DecodeError(
            f"hook name {_short(name)!r} declares {size} bytes of source, over the limit of {limit}; "
            "raise it with picklehooks.serialize.codec.set_max_source_bytes() if you trust this file"
        )
    try:
        raw, trailing = _decompress(frame, letter, size)
    except Exception as exc:  # zstd reports corruption with its own error types
        raise DecodeError(f"hook name {_short(name)!r} is corrupt: zstd says {exc}") from None
    if trailing:
        raise DecodeError(f"hook name {_short(name)!r} has {len(trailing)} bytes after its zstd frame")
    if len(raw) != size:
        raise DecodeError(f"hook name {_short(name)!r} is corrupt: {len(raw)} bytes decoded, {size} declared")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"hook name {_short(name)!r} does not decode to UTF-8 text: {exc}") from None


# --------------------------------------------------------------------------
# Checking the decoded text: it may only import and define.
#
# Executing a hook's text runs its module level: its imports, its constant
# assignments, and the one ``def`` statement, which evaluates the def's
# defaults and annotations. Each of those could call code: a call, an
# operator (``__neg__``, ``__or__``), a subscript (``__getitem__``,
# ``__class_getitem__``), an f-string (``__format__``), an attribute read
# (a module's ``__getattr__``), an import (the imported module's body). The
# check below tracks what every name is bound to and allows only what cannot
# run anything but trusted code; the def's *body* runs later, when the hook is
# called, exactly like any function the user registers.

#: Modules a hook may import in every mode (top-level package names);
#: ``trust=`` adds more. ``__future__`` is a compiler directive.
BASE_TRUSTED = ("torch", "typing", "math", "collections", "operator", "picklehooks", "__future__")

# The calls old generated text holds for non-finite floats and devices (see
# picklehooks.serialize.portable), allowed only when the callee provably is the real
# one: ``float`` can't be rebound (nothing may shadow a builtin) and ``torch``
# must be bound by a plain ``import torch``.
_SAFE_CALLS = {("float",): ((str,), 1), ("torch", "device"): ((str, int), 2)}
# Builtin types whose subscripts make typing aliases (list[int]) and nothing else.
_SUBSCRIPTABLE_BUILTINS = frozenset({"list", "tuple", "dict", "set", "frozenset", "type"})
# Modules whose names and attributes may be subscripted or or-ed in annotations.
_TYPING_ROOTS = frozenset({"typing", "torch"})
_BUILTIN_NAMES = frozenset(dir(builtins))


class _Policy:
    """Which modules a hook's text may import while it is decoded.

    ``trusted`` holds top-level package names. In the default mode a module
    that is already imported may be imported again (that runs nothing); under
    :func:`untrusted` only ``trusted`` modules may.
    """

    def __init__(self, trusted: tuple[str, ...] | None, allow_loaded: bool) -> None:
        self.trusted = None if trusted is None else frozenset(trusted)  # None: any module
        self.allow_loaded = allow_loaded

    def trusts(self, module: str) -> bool:
        return self.trusted is None or module.partition(".")[0] in self.trusted

    def refusal(self, module: str, names: tuple[str, ...] = ()) -> str | None:
        """Why importing ``module`` (``from module import names``) is refused, or None."""
        parts = module.split(".")
        if any(p == "__main__" for p in [*parts, *names]):
            return f"{module!r} names a __main__ module, which runs a program when imported"
        if module == HUB_NAME or (module == HUB_NAME.rpartition(".")[0] and HUB_NAME.rpartition(".")[2] in names):
            return "it imports the hub itself, which would decode further hooks while this one is decoded"
        if self.trusts(module):
            return None
        if self.allow_loaded:
            loaded = sys.modules.get(module)
            if isinstance(loaded, types.ModuleType) and all(
                n in loaded.__dict__ or f"{module}.{n}" in sys.modules for n in names
            ):
                return None  # importing what is already imported runs nothing
            return (
                f"{module!r} is not imported yet and is not a trusted package; importing it would run its "
                f"code. Import it yourself before loading this file if you trust it (import {parts[0]})"
            )
        return (
            f"{parts[0]!r} is not a trusted package here; if you trust it, "
            f"pass trust=[{parts[0]!r}] (trusted now: {', '.join(sorted(self.trusted))})"
        )


_DEFAULT_POLICY = _Policy(BASE_TRUSTED, allow_loaded=True)
# Inside a torch.package archive imports go through the archive's importer,
# which decides what exists (interned, externed or mocked modules): loading an
# archive runs its code anyway, so only the structural refusals apply there.
_PACKAGE_POLICY = _Policy(None, allow_loaded=False)
_policy_var: contextvars.ContextVar[_Policy] = contextvars.ContextVar("picklehooks_decode_policy")


@contextlib.contextmanager
def untrusted(trust: tuple[str, ...] | list[str] = ()):
    """Decode hooks met in this block as coming from a file nobody vouched for.

    Their text may import only :data:`BASE_TRUSTED` packages and those named
    in ``trust`` (top-level package names), even if others are already
    imported. ``picklehooks.safe_globals`` decodes this way.
    """
    names = tuple(trust)
    bad = [t for t in names if not isinstance(t, str) or not t.isidentifier()]
    if bad:
        raise PicklehooksError(f"trust= takes top-level package names such as 'mypkg', got {bad[0]!r}")
    token = _policy_var.set(_Policy(BASE_TRUSTED + names, allow_loaded=False))
    try:
        yield
    finally:
        _policy_var.reset(token)


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return True
    return isinstance(node, ast.Tuple) and all(_is_literal(e) for e in node.elts)


def _dotted(node: ast.AST) -> tuple[str, ...] | None:
    if isinstance(node, ast.Name):
        return (node.id,)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else (*base, node.attr)
    return None


class _Checker:
    """Checks one hook's text; see the comment above for what may run."""

    def __init__(self, tree: ast.Module, name: str, policy: _Policy) -> None:
        self.tree, self.name, self.policy = tree, name, policy
        self.modules: set[str] = set()  # every module path the text imports
        # name -> ("import", module bound) | ("from", module, attr) | ("const",) | ("def",)
        self.bindings: dict[str, tuple] = {}
        self.imports: list[tuple[str, tuple[str, ...]]] = []  # (module, names) run at decode time

    def refuse(self, node: ast.AST | None, why: str) -> DecodeError:
        line = f" (line {node.lineno})" if node is not None and hasattr(node, "lineno") else ""
        return DecodeError(f"hook {_short(self.name)!r} refused{line}: {why}")

    def bind(self, node: ast.AST, name: str, binding: tuple) -> None:
        if name.startswith("__") or name in _BUILTIN_NAMES:
            raise self.refuse(node, f"it binds {name!r}, which would shadow a builtin or module attribute")
        old = self.bindings.get(name)
        # ``import torch`` and ``import torch.nn`` both bind ``torch`` to the same module.
        if old is not None and not (old == binding and binding[0] == "import"):
            raise self.refuse(node, f"it binds {name!r} twice; each name may be bound once")
        self.bindings[name] = binding

    def check(self) -> str:
        """Return the def's name, or raise :class:`DecodeError` naming what was refused."""
        defs = []
        for stmt in self.tree.body:
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    self.imports.append((alias.name, ()))
                    parts = alias.name.split(".")
                    self.modules |= {".".join(parts[: i + 1]) for i in range(len(parts))}
                    if alias.asname:
                        self.bind(stmt, alias.asname, ("import", alias.name))
                    else:
                        root = alias.name.partition(".")[0]
                        self.bind(stmt, root, ("import", root))
            elif isinstance(stmt, ast.ImportFrom):
                if stmt.level or not stmt.module or any(a.name == "*" for a in stmt.names):
                    raise self.refuse(stmt, "only absolute imports of named objects are allowed")
                self.imports.append((stmt.module, tuple(a.name for a in stmt.names)))
                for alias in stmt.names:
                    if stmt.module != "__future__":
                        self.bind(stmt, alias.asname or alias.name, ("from", stmt.module, alias.name))
            elif isinstance(stmt, ast.Assign):
                if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
                    raise self.refuse(stmt, "an assignment may only bind one plain name")
                self.expr(stmt.value)
                self.bind(stmt, stmt.targets[0].id, ("const",))
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # a docstring
            elif isinstance(stmt, ast.FunctionDef):
                self.function(stmt)
                defs.append(stmt)
            else:
                raise self.refuse(
                    stmt,
                    f"it holds a {type(stmt).__name__} statement; hook text may only hold imports, "
                    "literal constants and one def",
                )
        if len(defs) != 1:
            raise DecodeError(f"hook {_short(self.name)!r} decodes to {len(defs)} function definitions, not exactly one")
        return defs[0].name

    def function(self, fn: ast.FunctionDef) -> None:
        if fn.decorator_list:
            raise self.refuse(fn, "its def has decorators, which would run when it is defined")
        if getattr(fn, "type_params", None):
            raise self.refuse(fn, "its def has type parameters")
        args = fn.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None and arg.annotation is not None:
                self.expr(arg.annotation)
        for default in [*args.defaults, *args.kw_defaults]:
            if default is not None:
                self.expr(default)
        if fn.returns is not None:
            self.expr(fn.returns)
        self.bind(fn, fn.name, ("def",))

    def expr(self, node: ast.AST) -> None:
        """Check an expression evaluated while the text runs (constant, default, annotation)."""
        if isinstance(node, ast.Constant):
            return
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self.expr(elt)
        elif isinstance(node, (ast.Set, ast.Dict)):
            # Building a set or dict hashes its items, which calls their __hash__.
            hashed = node.elts if isinstance(node, ast.Set) else node.keys
            if not all(k is not None and _is_literal(k) for k in hashed):
                raise self.refuse(node, "set items and dict keys must be literals (hashing runs code)")
            if isinstance(node, ast.Dict):
                for value in node.values:
                    self.expr(value)
        elif isinstance(node, ast.UnaryOp):
            if not (
                isinstance(node.op, (ast.USub, ast.UAdd))
                and isinstance(node.operand, ast.Constant)
                and type(node.operand.value) in (int, float, complex)
            ):
                raise self.refuse(node, "a unary operator may only apply to a number literal")
        elif isinstance(node, ast.Name):
            if node.id not in self.bindings and node.id not in _BUILTIN_NAMES:
                raise self.refuse(node, f"it uses {node.id!r} before binding it")
        elif isinstance(node, ast.Attribute):
            self.attribute(node)
        elif isinstance(node, ast.Subscript):
            self.typing_name(node.value, "subscript")
            self.expr(node.slice)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # `X | None` annotations
            for side in (node.left, node.right):
                if not (isinstance(side, ast.Constant) and side.value is None):
                    self.typing_name(side.value if isinstance(side, ast.Subscript) else side, "'|'")
                    self.expr(side)
        elif isinstance(node, ast.Call):
            self.call(node)
        else:
            raise self.refuse(
                node, f"a {type(node).__name__} expression would run code while the hook is defined"
            )

    def attribute(self, node: ast.Attribute) -> None:
        """An attribute chain must start at an imported module and avoid dunders.

        Reading an attribute of a module runs at most that module's
        ``__getattr__``; reading one of an arbitrary object runs its class's
        code. So beyond the modules the text imports, a chain may take one more
        step, unless the package is trusted (``torch.nn.Module``).
        """
        path = _dotted(node)
        if path is None:
            raise self.refuse(node, "an attribute may only be read from an imported name")
        shown = ".".join(path)
        if any(p.startswith("__") for p in path[1:]):
            raise self.refuse(node, f"it reads the special attribute {shown!r}")
        binding = self.bindings.get(path[0])
        if binding is None or binding[0] != "import":
            raise self.refuse(node, f"it reads {shown!r}, but {path[0]!r} is not bound by an 'import' statement")
        module = binding[1]
        if self.policy.trusts(module):
            return
        steps = list(path[1:])
        while steps and f"{module}.{steps[0]}" in self.modules:
            module = f"{module}.{steps.pop(0)}"
        if len(steps) > 1:
            raise self.refuse(node, f"it reads {shown!r}, through an object of the untrusted package {module!r}")

    def _module_of(self, node: ast.AST) -> str | None:
        """The imported module a Name/Attribute chain starts from, or None."""
        path = _dotted(node)
        if path is None:
            return None
        binding = self.bindings.get(path[0])
        if binding is None or binding[0] not in ("import", "from"):
            return None
        return binding[1]

    def typing_name(self, node: ast.AST, what: str) -> None:
        """``node`` is about to be subscripted or or-ed: it must be a typing, torch or builtin type name."""
        if isinstance(node, ast.Name) and node.id in _SUBSCRIPTABLE_BUILTINS and node.id not in self.bindings:
            return
        if isinstance(node, (ast.Name, ast.Attribute)):
            module = self._module_of(node)
            if module is not None and module.partition(".")[0] in _TYPING_ROOTS:
                if isinstance(node, ast.Attribute):
                    self.attribute(node)
                return
        shown = ast.unparse(node) if isinstance(node, ast.AST) else repr(node)
        raise self.refuse(
            node, f"{what} on {shown[:60]!r}: only typing, torch and builtin type names may be subscripted or or-ed"
        )

    def call(self, node: ast.Call) -> None:
        path = _dotted(node.func)
        allowed, most = _SAFE_CALLS.get(path, ((), 0)) if path is not None else ((), 0)
        genuine = path == ("float",) or self.bindings.get("torch") == ("import", "torch")
        if (
            not genuine
            or node.keywords
            or not 1 <= len(node.args) <= most
            or not all(isinstance(a, ast.Constant) and type(a.value) in allowed for a in node.args)
        ):
            shown = ast.unparse(node)
            raise self.refuse(
                node,
                f"it calls {shown[:60]!r} while being defined; constants, defaults and annotations must "
                "be literals or names (write math.inf / math.nan / torch.float32, not calls)",
            )


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

    def __init__(self, module_name: str, filename: str, policy: _Policy | None = None) -> None:
        self.module_name = module_name
        self.filename = filename
        self.policy = policy  # None: the caller's (default, or untrusted() inside that block)
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
        """Return the hook that ``name`` encodes, decoding it at most once per winner.

        Nothing raises out of here but :class:`DecodeError`, so ``hasattr``
        and pickle see a missing attribute whatever the text does. The lock is
        held only to publish: a hook's imports may import a module that
        resolves another hook at import time, in this thread or another one.
        Two threads racing on a first lookup may both define the hook; the
        first to publish wins and both return its object.
        """
        namespace = self._namespace
        cached = namespace.get(name)
        if cached is not None:
            return cached
        try:
            fn, hook_module, lines = self._define(name)
        except DecodeError:
            raise
        except (Exception, SystemExit) as exc:  # an import or a default that failed at run time
            raise DecodeError(
                f"hook {_short(name)!r} failed while being defined: {type(exc).__name__}: {_short(str(exc), 200)}"
            ) from None
        with self._lock:
            winner = namespace.setdefault(name, fn)
            if winner is fn:
                # torch.compile guards a global by importing f_globals["__name__"].
                sys.modules[hook_module.__name__] = hook_module
            else:  # the hub's text shows each hook once
                self._blank(*lines)
        return winner

    def _blank(self, offset: int, count: int) -> None:
        """Replace reserved lines by empty ones (under the lock), keeping later hooks' line numbers."""
        self._lines[offset : offset + count] = ["\n"] * count

    def _define(self, name: str) -> tuple[types.FunctionType, types.ModuleType, tuple[int, int]]:
        source = decode(name)
        _charge(len(source), name)
        try:
            tree = ast.parse(source, self.filename)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            raise DecodeError(f"hook {_short(name)!r} decodes to text that is not Python: {exc}") from None
        policy = self.policy if self.policy is not None else _policy_var.get(_DEFAULT_POLICY)
        checker = _Checker(tree, name, policy)
        def_name = checker.check()
        for module, names in checker.imports:
            why = policy.refusal(module, names)
            if why is not None:
                raise DecodeError(f"hook {_short(name)!r} refused: it imports {module!r} while being defined: {why}")
        if not source.endswith("\n"):
            source += "\n"
        lines = source.splitlines(keepends=True) + ["\n"]
        with self._lock:  # reserve this hook's lines, so that its line numbers stay its own
            offset = len(self._lines)
            self._lines.extend(lines)
        try:
            ast.increment_lineno(tree, offset)
            code = compile(tree, self.filename, "exec", dont_inherit=True)
            # Each hook gets its own globals (hooks' constants must not collide),
            # which are the dict of a real module named "<hub>.<name>".
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
        except BaseException:
            with self._lock:
                self._blank(offset, len(lines))
            raise
        fn = namespace[def_name]
        fn.__name__ = fn.__qualname__ = name
        fn.__module__ = self.module_name
        fn.__reduce_package__ = functools.partial(_reduce_package, name)
        # Refresh linecache: drop a realised (now stale) entry, leave a lazy one.
        linecache.cache.pop(self.filename, None)
        linecache.lazycache(self.filename, namespace)
        for callback in ON_DEFINE:
            callback(fn)
        return fn, hook_module, (offset, len(lines))


#: Called with each hook function the hub defines, once (the shim imports nothing else of picklehooks:
#: the hook runtime, which generated hooks import, puts its callback here; see
#: ``picklehooks._hookrt._top_frames_eager``). A callback must not raise.
ON_DEFINE: list = []

#: Default bound on the text one process decodes, over all hook names.
MAX_TOTAL_SOURCE_BYTES = 64 << 20
_total_lock = threading.Lock()
_total_decoded = 0


def _charge(nbytes: int, name: str) -> None:
    """Count decoded text against :data:`MAX_TOTAL_SOURCE_BYTES` (a file can't make us decode forever)."""
    global _total_decoded
    with _total_lock:
        if _total_decoded + nbytes > MAX_TOTAL_SOURCE_BYTES:
            raise DecodeError(
                f"hook {_short(name)!r} refused: this process already decoded {_total_decoded} bytes of hook "
                f"text, and {nbytes} more would pass the bound of {MAX_TOTAL_SOURCE_BYTES}; a file holding "
                "that many hooks is not one picklehooks wrote"
            )
        _total_decoded += nbytes


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
    _HubLoader(name, f"<picklehooks-generated>/{name}.py", _PACKAGE_POLICY).bind(namespace)


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
    """Every module a hook's text imports: at module level, and inside its body (run when called)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            names.append(node.module)
    return list(dict.fromkeys(names))


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
            def_name = _Checker(ast.parse(source), name, _PACKAGE_POLICY).check()
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
