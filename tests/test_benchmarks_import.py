"""Every benchmark script imports: a refactor that moves a function they use fails here,
not in the next person's benchmark run (benchmarks/ is not otherwise run by the suite)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BENCHMARKS = sorted(
    ".".join(p.relative_to(ROOT / "benchmarks").with_suffix("").parts)
    for p in (ROOT / "benchmarks").rglob("*.py")
    if p.stem != "__init__" and p.parent.name != "gpu"
)
KINDS = ("performance", "reproduction", "robustness", "deployment")


def test_benchmarks_are_grouped_by_kind() -> None:
    """Scripts live in a folder of their kind; only shared helpers sit at the top."""
    top = {name for name in BENCHMARKS if "." not in name}
    assert top == {"as_module", "common"}
    assert {name.split(".")[0] for name in BENCHMARKS} - top == set(KINDS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_imports(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    source = Path(module.__file__).read_text()
    if 'if __name__ == "__main__"' in source:  # a script (not a helper such as common.py)
        assert callable(getattr(module, "main", None)), f"benchmarks.{name} has no main()"


def test_scale_benchmark_times_functions_that_exist() -> None:
    """bench_scale wraps named clustering/aggregation functions with timers; a renamed
    or moved function must fail here, not in a 10,000-client child process."""
    from benchmarks.performance.bench_scale import STEPS

    for modules in STEPS.values():
        for module_name, names in modules.items():
            module = importlib.import_module(module_name)
            missing = [n for n in names if not callable(getattr(module, n, None))]
            assert not missing, f"{module_name} lacks {missing}"


def test_scale_benchmark_splits_clustering_by_round(tmp_path: Path) -> None:
    """bench_scale records each round's clustering seconds (FedGroup's cold start falls
    in round 1); they add up to the run's total and give the shares it prints."""
    import json
    import subprocess
    import sys

    from benchmarks.performance.bench_scale import clustering_shares

    out = tmp_path / "scale.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.performance.bench_scale",
        "--sizes",
        "200",
        "--rounds",
        "3",
    ]
    cmd += ["--algorithms", "fedgroup", "--threads", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=Path(__file__).parents[1])
    (result,) = json.loads(out.read_text())["results"]
    per = result["per_round"]
    assert len(per["clustering_seconds"]) == len(per["aggregation_seconds"]) == 3
    assert sum(per["clustering_seconds"]) == pytest.approx(result["clustering_seconds_total"])
    assert per["clustering_seconds"][0] > 0  # the cold start: SVD directions and k-means++
    first, later = clustering_shares(result)
    total = [c + s for c, s in zip(per["client_seconds"], per["server_seconds"], strict=True)]
    assert first == pytest.approx(per["clustering_seconds"][0] / total[0])
    assert later == pytest.approx(sum(per["clustering_seconds"][1:]) / sum(total[1:]))


@pytest.mark.parametrize("script", ["performance/bench_round.py", "performance/bench_ifca.py"])
def test_the_scripts_the_docs_run_as_files_start_on_a_fresh_checkout(script, tmp_path):
    """`python benchmarks/performance/bench_ifca.py ...` (the docs' form) finds the `benchmarks`
    package without the repository on PYTHONPATH, from any working directory (the
    path names only this checkout's fedcluster, as an installed checkout would)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT / "src")
    path = ROOT / "benchmarks" / script
    done = subprocess.run(
        [sys.executable, str(path), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {Path(script).name}")
