"""Run a benchmark script given by path as the package's module.

``python benchmarks/bench_ifca.py`` (the form the docs print) then behaves as
``python -m benchmarks.bench_ifca``: the package's ``__init__`` sets OpenMP's
wait policy before torch loads, and ``benchmarks.*`` imports resolve on a fresh
checkout without PYTHONPATH.
"""

from __future__ import annotations

import runpy
from pathlib import Path


def run_as_module(script: str) -> None:
    """Run ``benchmarks/<name>.py`` as ``benchmarks.<name>`` as the main module."""
    runpy.run_module(f"benchmarks.{Path(script).stem}", run_name="__main__", alter_sys=True)
