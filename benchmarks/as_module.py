"""Run a benchmark script given by path as the package's module.

``python benchmarks/performance/bench_ifca.py`` (the form the docs print) then behaves as
``python -m benchmarks.performance.bench_ifca``: the package's ``__init__`` sets OpenMP's
wait policy before torch loads, and ``benchmarks.*`` imports resolve on a fresh
checkout without PYTHONPATH.
"""

from __future__ import annotations

import runpy
from pathlib import Path


def run_as_module(script: str) -> None:
    """Run ``benchmarks/<kind>/<name>.py`` as ``benchmarks.<kind>.<name>``, the main module."""
    path = Path(script)
    module = f"benchmarks.{path.parent.name}.{path.stem}"
    runpy.run_module(module, run_name="__main__", alter_sys=True)
