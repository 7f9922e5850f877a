"""Largest |cpu - cuda| difference per algorithm and column of the smoke runs."""
import csv
import sys
from pathlib import Path

root = Path(sys.argv[1])
for model in ("mlp", "cnn"):
    paths = {d: root / f"{model}-{d}" / "metrics.csv" for d in ("cpu", "cuda")}
    if not all(p.exists() for p in paths.values()):
        print(model, "missing", [str(p) for p in paths.values() if not p.exists()])
        continue
    cpu, gpu = (list(csv.DictReader(open(p))) for p in paths.values())
    worst: dict[str, dict[str, float]] = {}
    for a, b in zip(cpu, gpu, strict=True):
        for col in ("accuracy", "loss", "purity", "ari"):
            try:
                d = abs(float(a[col]) - float(b[col]))
            except (ValueError, KeyError):
                continue
            w = worst.setdefault(a["algorithm"], {})
            w[col] = max(w.get(col, 0.0), d)
    for alg, cols in worst.items():
        print(model, alg, " ".join(f"{c}={v:.1e}" for c, v in cols.items()))
