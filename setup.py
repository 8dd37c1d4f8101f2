"""Build of the optional C extension ``picklehooks._speedups`` (sources in ``csrc/``); the metadata
is in pyproject.toml.

The extension is ``optional``: where it doesn't compile (no C compiler, no
Python headers), setuptools warns and installs the package without it, and
:mod:`picklehooks._native` uses its pure-Python twin instead (as it does with
``PICKLEHOOKS_NATIVE=0``). It needs no torch headers: the ``active`` op's
kernel is registered at run time through libtorch's stable C functions.
``PICKLEHOOKS_CFLAGS`` adds compiler flags, e.g. ``-DPICKLEHOOKS_NO_CLONES``
for one portable loop instead of GCC's per-CPU clones (see csrc/stats.c).
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
            "picklehooks._speedups",
            # In dependency order (see csrc/_speedups.h); _speedups.c holds the module's one init.
            sources=["csrc/_speedups.c", "csrc/stats.c", "csrc/rows.c", "csrc/hooks.c", "csrc/records.c",
                     "csrc/kernels.c", "csrc/tree.c"],
            depends=["csrc/_speedups.h"],
            extra_compile_args=compile_args,
            optional=True,
        ),
    ]
)
