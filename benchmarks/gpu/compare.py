"""Largest |cpu - cuda| difference per algorithm and column of the GPU check's smoke runs.

python benchmarks/gpu/compare.py /tmp/s    # holds mlp-cpu/, mlp-cuda/, cnn-cpu/, cnn-cuda/
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path


def rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


def main(root: Path) -> None:
    for model in ("mlp", "cnn"):
        paths = {d: root / f"{model}-{d}" / "metrics.csv" for d in ("cpu", "cuda")}
        if not all(p.exists() for p in paths.values()):
            print(model, "missing", [str(p) for p in paths.values() if not p.exists()])
            continue
        worst: dict[str, dict[str, float]] = {}
        for a, b in zip(rows(paths["cpu"]), rows(paths["cuda"]), strict=True):
            for col in ("accuracy", "loss", "purity", "ari"):
                try:
                    d = abs(float(a[col]) - float(b[col]))
                except (ValueError, KeyError):
                    continue
                w = worst.setdefault(a["algorithm"], {})
                w[col] = max(w.get(col, 0.0), d)
        for alg, cols in worst.items():
            print(model, alg, " ".join(f"{c}={v:.1e}" for c, v in cols.items()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
