"""Every benchmark script imports: a refactor that moves a function they use fails here,
not in the next person's benchmark run (benchmarks/ is not otherwise run by the suite)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted(
    p.stem for p in (Path(__file__).parents[1] / "benchmarks").glob("*.py") if p.stem != "__init__"
)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_imports(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    source = Path(module.__file__).read_text()
    if "__main__" in source:  # a script (not a helper module such as common.py) has a main()
        assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"
