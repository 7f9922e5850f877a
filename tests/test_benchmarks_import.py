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


def test_scale_benchmark_times_functions_that_exist() -> None:
    """bench_scale wraps named clustering/aggregation functions with timers; a renamed
    or moved function must fail here, not in a 10,000-client child process."""
    from benchmarks.bench_scale import STEPS

    for modules in STEPS.values():
        for module_name, names in modules.items():
            module = importlib.import_module(module_name)
            missing = [n for n in names if not callable(getattr(module, n, None))]
            assert not missing, f"{module_name} lacks {missing}"
