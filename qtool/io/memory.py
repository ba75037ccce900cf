"""How much host memory this process can still allocate (pack's and bench's checks before any work)."""

from __future__ import annotations

import os
import resource


def available_bytes() -> tuple[int, str]:
    """(bytes this process can still allocate, what limits it): the smaller of the memory the system reports
    available and the room left under the address-space limit (torch's own mappings count against it)."""
    limits = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append((int(line.split()[1]) * 1024, "memory available"))
                    break
    except (OSError, ValueError, IndexError):
        pass
    if not limits:
        try:
            limits.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free memory"))
        except (ValueError, OSError, AttributeError):
            pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((max(soft - _address_space_used(), 0), "room under the address-space limit (ulimit -v)"))
    if not limits:
        return 1 << 62, "unknown"
    return min(limits)


def _address_space_used() -> int:
    """This process's mapped address space (what RLIMIT_AS counts), from /proc/self/status; 0 if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
