"""Worker threads sized to the CPUs a run may use and that other processes leave free.

Graceful under load: the simulator runs client groups on
worker threads, each with one intra-op thread (:func:`fedcluster.engine.
threads.run_on_threads`). A worker that shares its core with another
CPU-bound process still makes progress, but the round ends only when the last
group does, and more runnable threads than free cores only add context
switches. So the number of workers actually started is

    min(requested, usable CPUs),  usable = CPUs in the affinity mask − CPUs busy elsewhere,

where the affinity mask is ``os.sched_getaffinity`` (a container's or
``taskset``'s CPU set, not the machine's) and "busy elsewhere" is the CPU time
that other processes used on those CPUs since the previous look (Linux
``/proc/stat`` per CPU, minus this process's own CPU time), rounded to whole
CPUs. Nothing that decides a result depends on it: the client groups are fixed
before (from the requested count), each group's arithmetic runs on one thread
whichever worker takes it, so the numbers are the same on a quiet and on a
busy machine.

Passive waiting (``OMP_WAIT_POLICY=PASSIVE``, set by :mod:`fedcluster` before
PyTorch starts OpenMP unless the user chose a policy) keeps OpenMP's idle
threads from spinning on cores that another process needs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

Job = TypeVar("Job")

MIN_WINDOW_S = 0.1
"""Load looks closer together than this reuse the previous estimate (``/proc/stat``
counts in ticks of 10 ms: shorter windows are too coarse)."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` without one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class _Sample:
    wall: float
    busy: float  # busy CPU seconds of the affinity CPUs (all processes)
    own: float  # CPU seconds of this process


def _read_busy(cpus: set[int] | None, path: str = "/proc/stat") -> float | None:
    """Busy CPU seconds (user, nice, system, irq, softirq, steal) summed over ``cpus``."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return None
    total = 0
    seen = False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if not name[3:].isdigit() or (cpus is not None and int(name[3:]) not in cpus):
            continue
        v = [int(t) for t in rest.split()] + [0] * 8
        total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        seen = True
    return total / tick if seen else None


class LoadMonitor:
    """How many of this process's CPUs other processes keep busy, from the interval
    since the previous call (cheap: one read of ``/proc/stat``)."""

    def __init__(self, stat_path: str = "/proc/stat") -> None:
        self._path = stat_path
        self._lock = threading.Lock()
        self._cpus = _affinity()
        self._last: _Sample | None = None
        self._estimate = 0.0

    def _sample(self) -> _Sample | None:
        busy = _read_busy(self._cpus, self._path)
        if busy is None:
            return None
        return _Sample(time.monotonic(), busy, time.process_time())

    def busy_elsewhere(self) -> float:
        """CPUs (of the affinity mask) that other processes used since the last call.

        The first call looks over a short window (``MIN_WINDOW_S``); calls closer
        together than that return the previous estimate. 0 where ``/proc`` is missing.
        """
        with self._lock:
            now = self._sample()
            if now is None:
                return 0.0
            if self._last is None:
                time.sleep(MIN_WINDOW_S)
                self._last, now = now, self._sample()
                if now is None:
                    return 0.0
            wall = now.wall - self._last.wall
            if wall < MIN_WINDOW_S:
                return self._estimate
            foreign = (now.busy - self._last.busy) - (now.own - self._last.own)
            self._estimate = max(0.0, foreign / wall)
            self._last = now
            return self._estimate


_MONITOR = LoadMonitor()


def usable_workers(
    requested: int, monitor: LoadMonitor | None = None, adaptive: bool = True
) -> int:
    """Worker threads to start for ``requested`` parallel jobs: at most the CPUs of the
    affinity mask and, if ``adaptive``, at most those other processes leave free
    (rounded); at least 1."""
    cpus = available_cpus()
    if requested <= 1:
        return 1
    if not adaptive:
        return min(requested, cpus)
    busy = min(float(cpus), (monitor or _MONITOR).busy_elsewhere())
    return max(1, min(requested, cpus, int(cpus - busy + 0.5)))


def run_on_threads(
    run: Callable[[Job], None], jobs: Sequence[Job], threads: int, adaptive: bool = True
) -> None:
    """``run(job)`` for every job, on up to ``threads`` worker threads.

    Each worker runs single-threaded operators (PyTorch releases the GIL inside
    them): small operators keep a core busier this way than split across cores
    inside one operator, and no sleeping OpenMP thread has to be woken for each
    (passive waiting, above). Jobs write disjoint outputs, and each job's
    arithmetic does not depend on the thread, so results are identical.
    Fewer workers start where the affinity mask has fewer CPUs or, with
    ``adaptive`` (the simulator's default thread count), where other processes
    keep some busy (:func:`usable_workers`).
    """
    if min(threads, len(jobs)) <= 1:
        for job in jobs:
            run(job)
        return
    workers = min(usable_workers(threads, adaptive=adaptive), len(jobs))
    intra = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if workers <= 1:  # the load leaves one CPU: the same single-threaded jobs in turn
            for job in jobs:
                run(job)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(run, jobs))
    finally:
        torch.set_num_threads(intra)
