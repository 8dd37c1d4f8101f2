"""See what loading a checkpoint or pickle would run, without loading it.

``python -m picklehooks inspect FILE`` (and :func:`audit_file`,
:func:`find_hooks`) reads everything ``torch.load`` reads:

* a ``torch.save`` checkpoint (a zip holding ``<archive>/data.pkl``),
* a ``torch.package`` archive (a zip with ``.pkl`` resources anywhere, and
  the Python modules it bundles),
* a legacy ``torch.save`` file (several pickles, then raw storage bytes),
  and the legacy *tar* format (``storages``, ``tensors``, ``pickle``),
* a NumPy ``.npy`` file, or ``.npz`` (a zip of them): the header (magic,
  version, header length, dict literal, read without numpy), and behind it
  the pickle ``numpy.load(allow_pickle=True)`` runs when the ``descr`` may
  hold objects (``'|O'``); an array of plain data is fine, or
* a plain pickle of any protocol (0-5), possibly several concatenated,

each part as CPython's C unpickler reads it: text literals (``INT``,
``LONG``, ``FLOAT``, ``GET``, ``PUT``) end at a NUL as C strings do, and
``strtol`` takes any number of leading zeros. FRAMEs: ``pickle.loads``
reads a frame in place, but a file reader (``pickle.load``; ``torch.load``,
also for ``data.pkl`` through ``BytesIO``) reads it as one buffer and,
where an argument runs past the frame's end, drops the rest of the frame
and reads on after it; after a STOP inside a frame it starts the next pickle
at the frame's end. Every FRAME whose declared length does not end on an
opcode boundary is reported UNSAFE, naming its offset, and the part is
read each way (in place, dropping as ``BytesIO`` does, then the mixes a
buffered file can make, up to 16 readings per part),

and reports

* every global loading would import or call, however the pickle names it
  (``GLOBAL``, ``STACK_GLOBAL`` on memoized strings, protocol-4 dotted names,
  ``getattr`` chains, ``importlib.import_module``), marking as UNSAFE each one
  outside ``torch.load(weights_only=True)``'s default allowlist that is not
  a picklehooks hook: ``os.system``, ``builtins.exec``, and a whole model's
  own classes alike;
* every picklehooks hook (``picklehooks._hub.<name>``): the module it is
  registered on, its kind (``forward``, ``backward``, ``state_dict`` ...),
  the source text its name encodes and the modules that text imports;
* hooks that are not picklehooks hooks, as *foreign* (their code is not in
  the file);
* every module a ``torch.package`` archive bundles, and whether its
  ``picklehooks`` modules are the ones this version writes (a tampered
  ``picklehooks/_shim.py`` is UNSAFE);
* every part it could not read completely: "could not read X: ...; treat as
  unsafe";
* every FRAME that does not end on an opcode boundary, as UNSAFE.

Nothing from the file runs. The opcodes are read by a symbolic machine
(:mod:`._machine`) that follows ``_pickle.c``'s rules but builds placeholders
instead of objects: no ``pickle.load``, no import, no call. Hook names are
only decompressed (never resolved through the hub) and their text is parsed
with :mod:`ast`, never compiled.

Exit status of ``inspect`` (bits, added together): 0 everything read, only
allowlisted globals and decodable hooks; 1 the file can't be audited (one
line on stderr, nothing on stdout; also when a bound below is hit);
2 a hook name doesn't decode; 4 something is UNSAFE (a global outside the
allowlist, bundled code, an irregular FRAME); 8 some part could not be read
completely.

Bounds (memory and time grow with the file's size, never beyond a cap; see
:mod:`._limits`): bytes read from archive members, 32x the file's size
between 16 MiB and 256 MiB, checked against both the declared and the
actual size; 2,000,000 opcodes per file; 100,000 archive members; 64 Mi
characters of distinct global names; decoded hook text, 16x the file's size
between 1 MiB and 16 MiB; printed output, twice that plus 8 MiB; locations
("['model'].encoder.0") cut at 200 characters.

Limits: the allowlist is the default one (``add_safe_globals`` is not
consulted). Module paths are known only where the pickle shows them (see
:mod:`._hooks`). Globals reached through ``copyreg`` extension codes, or
through calls other than ``getattr``/``import_module``/``__import__``/
``picklehooks._shim.hub``, are not named, but the calls that reach them are
themselves UNSAFE globals. Only ``.pkl`` members of a zip, and members that
start like a ``.npy`` file, are read. Integers follow a 64-bit C ``long``.
"""

from __future__ import annotations

from ._cli import _printable, _write, main
from ._hooks import HookEntry
from ._limits import AuditError
from ._report import (
    EXIT_INCOMPLETE,
    EXIT_UNDECODABLE,
    EXIT_UNREADABLE,
    EXIT_UNSAFE,
    AuditReport,
    GlobalUse,
    audit_file,
    find_hooks,
)

__all__ = [
    "AuditError",
    "AuditReport",
    "GlobalUse",
    "HookEntry",
    "audit_file",
    "find_hooks",
    "main",
    "EXIT_UNREADABLE",
    "EXIT_UNDECODABLE",
    "EXIT_UNSAFE",
    "EXIT_INCOMPLETE",
]
