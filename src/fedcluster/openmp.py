"""OpenMP's wait policy for fedcluster's own entry points.

Idle OpenMP threads that spin keep cores busy that other processes need;
``OMP_WAIT_POLICY=PASSIVE`` makes them sleep instead. OpenMP reads the
variable once, when PyTorch loads it, so it must be set before ``import
torch``. ``import fedcluster`` changes nothing in the process: the entry
points that own their process call :func:`prefer_passive_wait` first -- the
``fedcluster`` command and ``python -m fedcluster`` (:func:`fedcluster.cli.main`),
the Flower worker (:mod:`fedcluster.flower.worker`) and the benchmarks
(``benchmarks/__init__.py``). A program of your own may call it before it
imports torch; a policy already set is kept.
"""

from __future__ import annotations

import os


def prefer_passive_wait() -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless a policy is set (effective before torch loads)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
