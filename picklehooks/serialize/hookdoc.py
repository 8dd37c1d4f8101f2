"""Hooks as text in files that hold no pickle: an HF model directory's ``config.json``, safetensors metadata.

A portable hook is a name (its compressed source), so a model's hooks fit in
a JSON document, stored under the key ``"picklehooks"``: in ``config.json``
(``from_pretrained`` keeps unknown keys), or, as JSON text, in the
``__metadata__`` of a ``.safetensors`` file (string to string)::

    {"format": "picklehooks.hooks", "version": 1,
     "spec": {... an instrumentation spec, or null ...},
     "hooks": [{"module": "encoder.0", "kind": "forward", "order": 0, "name": "aEQVB...",
                "with_kwargs": false, "prepend": false, "always_call": false}, ...]}

``kind`` is ``forward_pre``, ``forward``, ``backward_pre`` or ``backward``
(full backward hooks); ``order`` is the hook's place among the saved hooks of
that module and kind; ``prepend`` says it ran before picklehooks' own
instrumentation hooks. Nothing here decodes a name or runs anything: this
module writes and reads the document and checks its shape.

Limits: writing into a safetensors file rewrites the file (the header grows;
the tensor bytes are copied unchanged); a safetensors header over
:data:`MAX_HEADER_BYTES` is refused; ``config.json`` is rewritten with sorted
keys and two-space indents, as ``transformers`` writes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile

from .._shim import PicklehooksError

__all__ = ["KEY", "FORMAT", "VERSION", "KINDS", "fingerprint", "locate", "read", "write", "check", "safetensors_metadata"]

KEY = "picklehooks"
FORMAT, VERSION = "picklehooks.hooks", 1
KINDS = ("forward_pre", "forward", "backward_pre", "backward")
MAX_HEADER_BYTES = 100 << 20  # safetensors itself refuses headers over 100 MB
_FLAGS = ("with_kwargs", "prepend", "always_call")
_ACCEPTED = "an HF model directory (with config.json), a config.json file, or a .safetensors file"


def fingerprint(name: str) -> str:
    """A hook's short fingerprint (16 hex digits of SHA-256 of its name), as ``inspect`` shows it and
    ``load_hooks(trust=[...])`` takes it."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def locate(path: str | os.PathLike) -> tuple[str, str]:
    """``("config", file)`` or ``("safetensors", file)``: where the document of ``path`` lives."""
    path = os.fspath(path)
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise PicklehooksError(f"{path!r} has no config.json; give {_ACCEPTED}")
        return "config", config
    if path.endswith(".safetensors"):
        return "safetensors", path
    if path.endswith(".json"):
        return "config", path
    raise PicklehooksError(f"{path!r}: give {_ACCEPTED}")


def check(doc, where: str = "the document") -> dict:
    """``doc`` if it has the shape above; otherwise say precisely what is wrong (nothing is decoded)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PicklehooksError(f"{where} is not a picklehooks hooks document (format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise PicklehooksError(f"{where} has version {doc.get('version')!r}; this picklehooks reads version "
                               f"{VERSION}: upgrade picklehooks")
    if doc.get("spec") is not None and not isinstance(doc["spec"], dict):
        raise PicklehooksError(f"{where}: spec must be an object or null")
    hooks = doc.get("hooks")
    if not isinstance(hooks, list):
        raise PicklehooksError(f"{where}: hooks must be a list")
    for i, hook in enumerate(hooks):
        ok = (isinstance(hook, dict) and isinstance(hook.get("module"), str) and hook.get("kind") in KINDS
              and isinstance(hook.get("name"), str) and isinstance(hook.get("order"), int)
              and all(isinstance(hook.get(flag, False), bool) for flag in _FLAGS))
        if not ok:
            raise PicklehooksError(f"{where}: hook {i} ({str(hook)[:80]}) needs module (str), kind (one of "
                                   f"{', '.join(KINDS)}), order (int), name (str) and true/false flags")
    return doc


def read(path: str | os.PathLike) -> dict | None:
    """The checked document of ``path``, or ``None`` when it holds none."""
    kind, file = locate(path)
    if kind == "config":
        config = _read_json(file)
        doc = config.get(KEY)
    else:
        text = safetensors_metadata(file).get(KEY)
        if text is None:
            return None
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise PicklehooksError(f"{file!r}: its {KEY!r} metadata is not JSON ({exc})") from None
    return None if doc is None else check(doc, f"{file!r}'s {KEY!r} entry")


def write(path: str | os.PathLike, doc: dict) -> str:
    """Put ``doc`` into ``path`` (replacing an earlier one, keeping everything else); return the file written."""
    check(doc)
    kind, file = locate(path)
    if kind == "config":
        config = _read_json(file)
        config[KEY] = doc
        _replace(file, lambda out: out.write((json.dumps(config, indent=2, sort_keys=True) + "\n").encode()))
    else:
        header, start = _safetensors_header(file)
        metadata = dict(header.get("__metadata__") or {})
        metadata[KEY] = json.dumps(doc, sort_keys=True)
        header["__metadata__"] = metadata
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data that follows to 8 bytes

        def copy(out):
            out.write(struct.pack("<Q", len(text)) + text)
            with open(file, "rb") as src:
                src.seek(start)
                shutil.copyfileobj(src, out)
        _replace(file, copy)
    return file


def safetensors_metadata(file: str | os.PathLike) -> dict:
    """The ``__metadata__`` of a safetensors file (string to string), read from its header alone."""
    header, _ = _safetensors_header(file)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise PicklehooksError(f"{os.fspath(file)!r}: its __metadata__ is not an object")
    return metadata


def _safetensors_header(file) -> tuple[dict, int]:
    file = os.fspath(file)
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise PicklehooksError(f"{file!r} is not a safetensors file: it is shorter than 8 bytes")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER_BYTES:
                raise PicklehooksError(f"{file!r}: its header claims {size} bytes, over {MAX_HEADER_BYTES}; "
                                       "not a safetensors file this reads")
            text = f.read(size)
    except OSError as exc:
        raise PicklehooksError(f"can't read {file!r}: {exc.strerror}") from None
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise PicklehooksError(f"{file!r} is not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise PicklehooksError(f"{file!r} is not a safetensors file: its header is not an object")
    return header, 8 + size


def _read_json(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise PicklehooksError(f"can't read {file!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise PicklehooksError(f"{file!r} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise PicklehooksError(f"{file!r} holds no JSON object")
    return config


def _replace(file: str, fill) -> None:
    """Write a new ``file`` beside it, then swap it in: a failure leaves the old file as it was."""
    fd, temp = tempfile.mkstemp(prefix=".picklehooks-", suffix=".tmp", dir=os.path.dirname(os.path.abspath(file)))
    try:
        with os.fdopen(fd, "wb") as out:
            fill(out)
        shutil.copymode(file, temp)  # mkstemp's file is private (0600); keep the original's mode
        os.replace(temp, file)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
