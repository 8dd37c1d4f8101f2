"""The CPU a benchmark ran on, for its header (shared by the bench scripts).

Ratios measured on different CPUs differ: recording the MLP's statistics, the
same code measured 1.28× (median of six runs) on one host and 1.17× on another
(family 26, Zen 5), and /proc/cpuinfo names both just "AMD EPYC". So the
header also gives the CPU family and model, and the last-level cache, where
Linux says.
"""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path


def cpu_model() -> str:
    """"AMD EPYC (family 26, model 2; L3 32768K)" on Linux; the platform's processor name elsewhere."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                if fields:
                    break  # the first processor's block is enough
                continue
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    details = [f"family {fields['cpu family']}, model {fields['model']}"] if "cpu family" in fields and "model" in fields else []
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
    with contextlib.suppress(OSError, ValueError):
        last = max(caches, key=lambda p: int((p / "level").read_text()))
        details.append(f"L{(last / 'level').read_text().strip()} {(last / 'size').read_text().strip()}")
    return f"{name} ({'; '.join(details)})" if details else name
