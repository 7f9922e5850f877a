"""Test-time cluster choice on held-out devices of a finished rotation run.

A rotation run (the quickstart: mnist5k, 4 groups at 0/90/180/270 degrees)
trains on 5,000 images of MNIST's training set. The held-out devices are
drawn from MNIST's test set (10,000 images no client saw): ``--per-group``
devices of ``--samples`` images per rotation group, disjoint, rotated by the
group's angle (the run's ``data.partition`` angles), written as
``group<g>-device<i>.npz`` (``x``, ``y``, ``group``) into ``--out``. Each file
goes through :func:`fedcluster.assign` with ``record=True``, so the run's
``assign.csv`` holds every choice and ``fedcluster report RUN`` shows the
per-group table printed here: the accuracy of the label-free choices
(``entropy``, ``confidence``) beside the labelled one (``loss``).

    fedcluster run --preset quickstart --algorithms ifca,jgl,cflgt,dcfl,fedgroup \\
        --out runs/qs --no-report
    python -m benchmarks.reproduction.assign_heldout runs/qs --out runs/qs-heldout
    fedcluster assign runs/qs --data runs/qs-heldout/group2-device0.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from fedcluster.config.schema import load_yaml, validate_config
from fedcluster.data.configured import build_federation_for
from fedcluster.data.sources import load_dataset
from fedcluster.data.transforms import rotate_images
from fedcluster.experiment.cluster_choice import FinishedRun, summarise
from fedcluster.experiment.summary import format_table
from fedcluster.reporting.rundata import load_run
from fedcluster.rng import numpy_rng


def group_angles(run: Path, seed: int) -> list[float]:
    """The rotation angle of each true group of the run's federation (seed ``seed``)."""
    federation = build_federation_for(validate_config(load_yaml(run / "config.yaml")), seed)
    if federation.groups is None or federation.rotations is None:
        raise SystemExit(f"{run}: not a rotation run (its federation has no rotation groups)")
    groups = federation.groups
    return [float(federation.rotations[np.flatnonzero(groups == g)[0]]) for g in np.unique(groups)]


def write_devices(
    run: Path, out: Path, per_group: int, samples: int, seed: int, data_dir: str | None
) -> list[Path]:
    """Write the held-out devices' files; their paths, group by group."""
    angles = group_angles(run, 0)
    test = load_dataset("mnist", data_dir).test
    assert test is not None
    order = numpy_rng(seed, "held-out").permutation(len(test.y))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for g, angle in enumerate(angles):
        for i in range(per_group):
            start = (g * per_group + i) * samples
            idx = torch.as_tensor(order[start : start + samples])
            x = rotate_images(test.x[idx], angle).numpy().astype(np.float32)
            path = out / f"group{g}-device{i}.npz"
            np.savez(path, x=x, y=test.y[idx].numpy().astype(np.int64), group=np.int64(g))
            paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run", type=Path, help="a finished rotation run (e.g. the quickstart)")
    p.add_argument("--out", type=Path, required=True, help="folder for the devices' files")
    p.add_argument("--per-group", type=int, default=10, help="held-out devices per group")
    p.add_argument("--samples", type=int, default=100, help="images per device")
    p.add_argument("--seed", type=int, default=0, help="draw of the test images")
    p.add_argument("--data-dir", help="dataset root (default $FEDCLUSTER_DATA)")
    p.add_argument("--algorithms", help="comma-separated labels (default: every job)")
    args = p.parse_args()
    paths = write_devices(
        args.run, args.out, args.per_group, args.samples, args.seed, args.data_dir
    )
    labels = args.algorithms.split(",") if args.algorithms else None
    run = FinishedRun.load(args.run, labels)
    for path in paths:
        run.assign(run.read(path), record=True)
    print(format_table(summarise(load_run(args.run).assign)))


if __name__ == "__main__":
    main()
