"""What qlite asks of the machine: CPU feature flags (read once) and its cache directory."""
from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cache_dir() -> Path:
    """qlite's cache (the demo model, compiled kernels): $QLITE_CACHE or ~/.cache/qlite."""
    return Path(os.environ.get("QLITE_CACHE", Path.home() / ".cache" / "qlite"))
