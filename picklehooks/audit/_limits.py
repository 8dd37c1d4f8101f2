"""The audit's error type, its bounds, and safe ways to show values taken from a file.

Every bound scales with the size of the file being audited, between a floor
(so that small files are never refused for being small) and an absolute cap
(so that a large file can't take unbounded memory). A file that needs more
than a bound allows is not audited further: the audit says which bound and
tells the user to treat the file as unsafe. See the package docstring for
the table of bounds.
"""

from __future__ import annotations

from typing import Any

from .._shim import PicklehooksError

MiB = 1 << 20

# Bytes read out of one zip/tar member, and out of all of them together:
# `MEMBER_RATIO` times the file's size, at least `MIN_MEMBER_BYTES`, at most
# `MAX_MEMBER_BYTES`. torch.save stores data.pkl uncompressed, so a real
# checkpoint is far below this; a deflate bomb (1 MB of zip, 1 GiB of
# zeros) is refused after `MIN_MEMBER_BYTES`, not after its gigabyte.
MEMBER_RATIO = 32
MIN_MEMBER_BYTES = 16 * MiB
MAX_MEMBER_BYTES = 256 * MiB
# Opcodes interpreted per file. Each one creates at most one symbolic value
# (about 150 bytes), so this caps the machine's memory near 300 MB whatever
# the pickle; a checkpoint of a large model needs a few thousand.
MAX_OPCODES = 2_000_000
# Members of a zip or tar archive looked at.
MAX_MEMBERS = 100_000
# Total text decoded from hook names: `DECODED_RATIO` times the file's size,
# between `MIN_DECODED_BYTES` and `MAX_DECODED_BYTES`. A hook name is a
# compressed text; without this bound 2,000 names of a few hundred bytes
# each decode to 2 GiB.
DECODED_RATIO = 16
MIN_DECODED_BYTES = 1 * MiB
MAX_DECODED_BYTES = 16 * MiB
# Characters printed by `inspect`: the decoded texts plus this much.
OUTPUT_SLACK = 8 * MiB
# Locations ("['model'].encoder.0") are cut after this many characters, so
# that a deep tree or a long key costs a bounded string per value, not a
# string as long as the path (a 40 KB file once built 22 GB of them).
MAX_LOCATION = 200


class AuditError(PicklehooksError, ValueError):
    """The file can't be audited: it is missing, unreadable, not a pickle/checkpoint, or exceeds a bound."""


class Limits:
    """The bounds for one file of ``file_size`` bytes (see the module constants)."""

    def __init__(self, file_size: int) -> None:
        self.file_size = file_size
        self.member_bytes = min(MAX_MEMBER_BYTES, max(MIN_MEMBER_BYTES, MEMBER_RATIO * file_size))
        self.opcodes_left = MAX_OPCODES
        self.decoded_bytes = min(MAX_DECODED_BYTES, max(MIN_DECODED_BYTES, DECODED_RATIO * file_size))
        self.output_chars = self.decoded_bytes * 2 + OUTPUT_SLACK
        self.global_chars = 0  # characters of distinct global paths so far


def exceeded(what: str, detail: str) -> AuditError:
    """The one error raised when a bound is hit: names the part, the bound, and what to do."""
    return AuditError(f"could not read {what}: {detail}; treat as unsafe")


def show(value: Any, width: int = 40) -> str:
    """A short, printable repr of a value from the file.

    Never calls ``repr`` on a big int (str(int) refuses more than 4,300
    digits and would raise) and never builds more than ``width`` characters
    of a long string's repr.
    """
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 96:
            return f"<int of {value.bit_length()} bits>"
        return repr(value)
    if isinstance(value, (str, bytes, bytearray)):
        head = value[: width + 1]
        text = repr(bytes(head) if isinstance(head, bytearray) else head)
        return text if len(value) <= width else text[: width - 3] + "..."
    if isinstance(value, float):
        return repr(value)
    return f"<{type(value).__name__}>"


def printable(text: str, *, one_line: bool = False) -> str:
    """Escape control characters: names and source come from the file and could
    otherwise move the cursor or recolour the terminal of whoever audits it."""
    keep = "\t" if one_line else "\n\t"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)
