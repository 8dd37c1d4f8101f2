"""Build of the optional C extensions ``picklehooks._fstats``, ``picklehooks._frow`` and
``picklehooks._fkernels``; the metadata is in pyproject.toml.

The extensions are ``optional``: where one doesn't compile (no C compiler, no
Python headers), setuptools warns and installs the package without it, and
:mod:`picklehooks._native` falls back: to the PyTorch statistics without
``_fstats``, to ``Log._add_tensor``'s Python path without ``_frow``, to the
``active`` op's Python kernel without ``_fkernels``. None needs torch's headers:
``_fkernels``' kernel is registered at run time through libtorch's stable C functions.
``PICKLEHOOKS_CFLAGS`` adds compiler flags, e.g. ``-DPICKLEHOOKS_NO_CLONES``
for one portable loop instead of GCC's per-CPU clones (see _fstats.c).
"""

import os
import sys

from setuptools import Extension, setup

# -O3 for the vectorised loops; -fno-math-errno so sqrt is one instruction.
# MSVC takes other flags and gets its defaults.
compile_args = [] if sys.platform == "win32" else ["-O3", "-fno-math-errno"]
if os.environ.get("PICKLEHOOKS_CFLAGS"):
    compile_args += os.environ["PICKLEHOOKS_CFLAGS"].split()

setup(
    ext_modules=[
        Extension(
            "picklehooks._fstats",
            sources=["picklehooks/_fstats.c"],
            extra_compile_args=compile_args,
            optional=True,
        ),
        Extension(
            "picklehooks._frow",
            sources=["picklehooks/_frow.c", "picklehooks/_fhook.c", "picklehooks/_frecords.c"],
            depends=["picklehooks/_frow.h"],
            extra_compile_args=compile_args,
            optional=True,
        ),
        Extension(
            "picklehooks._fkernels",
            sources=["picklehooks/_fkernels.c"],
            extra_compile_args=compile_args,
            optional=True,
        ),
    ]
)
