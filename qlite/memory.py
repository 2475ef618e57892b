"""Process memory readings (Linux /proc; elsewhere what resource offers)."""
from __future__ import annotations

import threading
from pathlib import Path


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def available_bytes() -> int | None:
    """Memory the machine can give without swapping (MemAvailable), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident memory now (anonymous plus mapped file pages)."""
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def anon_rss_bytes() -> int:
    """Resident anonymous memory now: the process's own allocations, not mmap'd file pages."""
    kib = _status_kib("RssAnon")
    return rss_bytes() if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    """Peak resident memory (VmHWM), mapped file pages included."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kib * 1024


class PeakAnonSampler:
    """Samples anonymous RSS every few milliseconds in a thread while the `with` block runs."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s, self.peak = interval_s, 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self.peak = anon_rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_rss_bytes())


def large_allocations_from_mmap() -> None:
    """Make glibc serve every allocation over 1 MiB with its own mapping, returned to the OS when
    freed. By default glibc raises that threshold after the first large free, and loading's or
    quantizing's temporaries then fragment the heap into resident memory that is never used again."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def release_freed_memory() -> None:
    """Hand the heap that loading freed (conversion and repacking temporaries) back to the OS;
    glibc keeps it otherwise, and it would show as resident memory for the life of the process."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def drop_pages(address: int, nbytes: int) -> None:
    """Drop the whole pages inside [address, address + nbytes) of a file mapping from this
    process (madvise MADV_DONTNEED): the next read of them faults them in again from the file. Only
    for mappings of files never written through (a private page written to would be lost)."""
    import ctypes
    import mmap

    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
