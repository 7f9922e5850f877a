"""How much memory this process may still allocate, checked before a large allocation.

The least of three limits, each where the system sets one:

- ``MemAvailable`` of ``/proc/meminfo`` (the machine's free and reclaimable memory);
- the memory cgroup's limit less its usage: cgroup v2 ``memory.max`` −
  ``memory.current``, cgroup v1 ``memory.limit_in_bytes`` − ``memory.usage_in_bytes``
  (a container's limit, which ``MemAvailable`` does not show);
- ``RLIMIT_AS`` (``ulimit -v``) less the address space already mapped (``VmSize``).

Without any of them (another platform), the machine's physical memory.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 2**62
"""Stands for "no limit" (cgroup v1 writes its own huge number, v2 ``max``)."""


def physical_bytes() -> int:
    """Physical memory of this machine in bytes (a generous upper bound for one model)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not available on this platform
        return UNLIMITED


def _read_int(path: Path) -> int | None:
    """The number a cgroup or proc file holds (``max``: unlimited); ``None`` when absent."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return min(int(text), UNLIMITED)
    except ValueError:
        return None


def _meminfo(key: str, path: Path = Path("/proc/meminfo")) -> int | None:
    """A ``/proc/meminfo`` (or ``/proc/self/status``) entry in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[tuple[Path, str, str]]:
    """The memory cgroup directories of this process with their (limit, usage) file names:
    its own (from ``/proc/self/cgroup``), then the mount's root (a container sees its
    cgroup there)."""
    own_v1 = own_v2 = None
    try:
        for line in proc_cgroup.read_text().splitlines():
            number, controllers, path = line.split(":", 2)
            if number == "0" and not controllers:
                own_v2 = path.lstrip("/")
            elif "memory" in controllers.split(","):
                own_v1 = path.lstrip("/")
    except (OSError, ValueError):
        pass
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    v2 = ("memory.max", "memory.current")
    dirs = []
    for own, base, names in ((own_v1, root / "memory", v1), (own_v2, root, v2)):
        for folder in ([base / own] if own else []) + [base]:
            dirs.append((folder, *names))
    return dirs


def cgroup_free_bytes(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """What the memory cgroup still allows this process (limit − usage), the least over
    the cgroup files found; ``None`` when no limit is set or none can be read."""
    free = []
    for folder, limit_name, usage_name in _cgroup_dirs(root, proc_cgroup):
        limit = _read_int(folder / limit_name)
        if limit is None or limit >= UNLIMITED // 2:
            continue
        usage = _read_int(folder / usage_name) or 0
        free.append(max(0, limit - usage))
    return min(free) if free else None


def rlimit_free_bytes(status: Path = Path("/proc/self/status")) -> int | None:
    """What ``RLIMIT_AS`` still allows (its soft limit less ``VmSize``); ``None`` unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    return max(0, soft - (_meminfo("VmSize", status) or 0))


def allowed_bytes() -> int:
    """Memory this process may still allocate: the least of ``MemAvailable``, the cgroup's
    free memory and ``RLIMIT_AS``'s (module docstring)."""
    limits = [_meminfo("MemAvailable"), cgroup_free_bytes(), rlimit_free_bytes()]
    found = [x for x in limits if x is not None]
    return min(found) if found else physical_bytes()
