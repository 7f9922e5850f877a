"""Accuracy and purity with ``precision: bf16`` against fp32.

Runs the same config twice, ``precision=fp32`` and ``precision=bf16``, over
several seeds, and prints per algorithm the mean final accuracy and purity of
both and their difference (goal: within 0.3 points):

- ``quickstart``: the main job as it is (7 algorithms, 25 rounds);
- ``ifca``: IFCA's rotated MNIST (preset ``ifca-rotated-mnist``, IFCA only) at
  ``--clients-per-group`` clients per rotation (600 in the preset) and
  ``--rounds`` rounds (50 by default).

    python -m benchmarks.performance.bf16_accuracy --setting quickstart --seeds 3 \\
        --out runs/bf16-quick
    python -m benchmarks.performance.bf16_accuracy --setting ifca --seeds 3 --rounds 50 \
        --clients-per-group 60 --out runs/bf16-ifca

On a CPU without AVX512-BF16/AMX the bf16 run falls back to fp32 (one warning)
and the two columns agree exactly.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from benchmarks.common import parser
from benchmarks.performance.bench_round import machine_info
from fedcluster.reproduce import run_setting, save_json

SETTINGS = {
    "quickstart": ("quickstart", []),
    "ifca": (
        "ifca-rotated-mnist",
        ["algorithms=[{name: ifca, params: {n_clusters: 4, choice_batches: all, "
         "weighting: uniform}}]"],
    ),
}  # fmt: skip


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--setting", choices=SETTINGS, default="quickstart")
    p.add_argument("--clients-per-group", type=int, default=60, help="ifca: clients per rotation")
    p.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = p.parse_args()
    preset, sets = SETTINGS[args.setting]
    sets = [*sets, *args.set]
    if args.setting == "ifca":
        n = args.clients_per_group
        sets = [
            *sets,
            f"data.partition.base_options.n_clients={n}",
            f"data.partition.test_clients={min(100, n)}",
        ]
    rounds = args.rounds or (50 if args.setting == "ifca" else None)
    load_before = os.getloadavg()
    table: dict[str, dict[str, list[float]]] = {}
    walls: dict[str, float] = {}
    for precision in ("fp32", "bf16"):
        t0 = time.perf_counter()
        jobs = run_setting(
            preset,
            [*sets, f"precision={precision}"],
            args.seeds,
            Path(args.out) / precision,
            args.data_dir,
            rounds,
            args.first_seed,
        )
        walls[precision] = time.perf_counter() - t0
        for j in jobs:
            cell = table.setdefault(j["algorithm"], {})
            cell.setdefault(f"{precision}_accuracy", []).append(j["final_accuracy"])
            if j["final_purity"] is not None:
                cell.setdefault(f"{precision}_purity", []).append(j["final_purity"])
    print(f"{'algorithm':<10}{'acc fp32':>10}{'acc bf16':>10}{'Δ':>7}{'pur fp32':>10}"
          f"{'pur bf16':>10}{'Δ':>7}")  # fmt: skip
    summary = {}
    for alg, cell in table.items():
        row = {k: 100 * float(np.mean(v)) for k, v in cell.items()}
        summary[alg] = row | {"per_seed": cell}
        acc = (row["fp32_accuracy"], row["bf16_accuracy"])
        pur = (row.get("fp32_purity"), row.get("bf16_purity"))
        text = f"{alg:<10}{acc[0]:10.2f}{acc[1]:10.2f}{acc[1] - acc[0]:7.2f}"
        if pur[0] is not None and pur[1] is not None:
            text += f"{pur[0]:10.2f}{pur[1]:10.2f}{pur[1] - pur[0]:7.2f}"
        print(text)
    print(f"wall s: fp32 {walls['fp32']:.0f}, bf16 {walls['bf16']:.0f}; load {load_before} -> "
          f"{os.getloadavg()}")  # fmt: skip
    save_json(
        Path(args.out) / "bf16_accuracy.json",
        {
            "machine": machine_info(),
            "setting": args.setting,
            "sets": sets,
            "rounds": rounds,
            "seeds": args.seeds,
            "wall_seconds": walls,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "results": summary,
        },
    )


if __name__ == "__main__":
    main()
