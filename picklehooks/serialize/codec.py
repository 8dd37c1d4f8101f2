"""Hook source <-> identifier codec.

A name is one format letter followed by base32 of a zstd frame, with base32's
``=`` padding mapped to ``_``. The letter says how to decode the rest
(:data:`FORMATS`); today there is one format, ``a``: zstd at level 19 with a
raw-content dictionary of common hook idioms that ships inside the shim. The
frame's 4-byte magic number is dropped (the letter already says "zstd") and
it keeps its content size and checksum, so truncated or mutated names are
caught before and after decompression.

Every name is a valid Python identifier without ``.``: the letter is
lowercase ASCII, base32 is ``A-Z2-7`` and ``_``.

Limits: names are deterministic for a given zstd library version (the
``zstandard`` wheel pins one); a different libzstd may compress the same source
to a different, equally decodable name. Decoding lives in the shim
(:mod:`picklehooks._shim`) so that it can travel without the rest of the
package; this module adds encoding.

>>> from picklehooks import codec
>>> codec.decode(codec.encode("def f(x):\\n    return x\\n"))
'def f(x):\\n    return x\\n'
"""

from __future__ import annotations

import base64
import functools

from .._shim import (
    _ZSTD_MAGIC,
    CURRENT_FORMAT,
    FORMATS,
    MAX_SOURCE_BYTES,
    DecodeError,
    PicklehooksError,
    decode,
    set_max_source_bytes,
)

__all__ = [
    "encode",
    "decode",
    "DecodeError",
    "SourceTooLargeError",
    "set_max_source_bytes",
    "FORMATS",
    "MAX_SOURCE_BYTES",
]


class SourceTooLargeError(PicklehooksError, ValueError):
    """The source text is over the size bound that decoders enforce by default.

    It is also a :class:`ValueError`, which is what :func:`encode` raised
    before this class existed.
    """

_LEVEL = 19


@functools.lru_cache(maxsize=None)
def _compressor(letter: str):
    dictionary = FORMATS[letter]
    try:
        import zstandard
    except ImportError:  # pragma: no cover - Python 3.14+ without zstandard
        from compression import zstd

        options = {
            zstd.CompressionParameter.compression_level: _LEVEL,
            zstd.CompressionParameter.checksum_flag: 1,
            zstd.CompressionParameter.content_size_flag: 1,
            zstd.CompressionParameter.dict_id_flag: 0,
        }
        zdict = zstd.ZstdDict(dictionary.encode(), is_raw=True) if dictionary is not None else None
        return lambda data: zstd.compress(data, options=options, zstd_dict=zdict)
    zdict = (
        zstandard.ZstdCompressionDict(dictionary.encode(), dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        if dictionary is not None
        else None
    )
    compressor = zstandard.ZstdCompressor(
        level=_LEVEL, dict_data=zdict, write_checksum=True, write_content_size=True, write_dict_id=False
    )
    return compressor.compress


def encode(source: str, *, format: str = CURRENT_FORMAT) -> str:
    """Return the identifier that encodes ``source``.

    ``format`` picks a format letter from :data:`FORMATS` (the current one by
    default); it exists so that tests and benchmarks can compare formats.
    """
    if not isinstance(source, str):
        raise TypeError(f"encode() takes the source text as a str, got {type(source).__name__}")
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; known formats: {', '.join(sorted(FORMATS))}")
    raw = source.encode("utf-8")
    if len(raw) > MAX_SOURCE_BYTES:
        # The bound is the shim's default, not whatever set_max_source_bytes()
        # chose here: a name must decode in a fresh process that changed nothing.
        raise SourceTooLargeError(
            f"source of {len(raw)} bytes (UTF-8) is over the {MAX_SOURCE_BYTES}-byte bound that decoders "
            f"enforce by default, so its name would not load elsewhere; make the hook smaller (move large "
            f"constants into a tensor, buffer or file the hook reads instead of baking them into its text)"
        )
    frame = _compressor(format)(raw)
    if not frame.startswith(_ZSTD_MAGIC):  # pragma: no cover - would be a zstd bug
        raise RuntimeError("zstd produced a frame without its magic number")
    payload = base64.b32encode(frame[len(_ZSTD_MAGIC) :]).decode("ascii")
    return format + payload.replace("=", "_")
