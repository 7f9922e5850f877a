"""IFCA's cluster choices round by round (why IFCA's rotated CIFAR-10
ends in one cluster).

Runs a preset like ``fedcluster run`` (same ``--set`` assignments, same run directory)
with IFCA instrumented: every round it records, for each client that chose, its
rotation group, its loss under each of the K broadcast models (the decision query
IFCA's choice is made from) and its choice; every ``--probe-every`` rounds it also
asks *every* training client for its K losses on all its training data (eval mode,
no augmentation: what the choice sees), so the table shows which model each group
prefers and by how much, whether or not the client was selected. The probe is a
measurement (no traffic counted, no state changed).

Written to ``--out``: the run directory, ``choices.csv`` (round, kind = chosen or
probe, client, group, loss_0 .. loss_{K-1}, choice) and ``groups.csv`` (per round
and kind: for each group the share choosing each model and the mean loss of each
model). One line per probe round is printed::

    python -m benchmarks.reproduction.ifca_cifar_diag --preset ifca-rotated-cifar10 --rounds 3 \\
        --set data.partition.base_options.n_clients=5 --set train.epochs=1 \\
        --set participation.fraction=0.5 --out runs/ifca-diag
"""

from __future__ import annotations

import argparse
import csv
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import default_data_dir
from fedcluster.algorithms.base import RoundOutput
from fedcluster.algorithms.cluster_models import ClusterModelAlgorithm, ClusterModelState
from fedcluster.algorithms.ifca import IFCA
from fedcluster.config.schema import resolve_config
from fedcluster.experiment.runner import Experiment
from fedcluster.protocol.channel import Replies


class ChoiceLog:
    """Appends IFCA's per-client losses and choices to the two CSV tables as they come."""

    def __init__(self, out: Path, probe_every: int) -> None:
        self.out = out
        self.probe_every = probe_every
        self.k: int | None = None

    def add(
        self, rnd: int, kind: str, clients: np.ndarray, groups: np.ndarray, losses: np.ndarray
    ) -> None:
        k = losses.shape[1]
        if self.k is None:
            self.k = k
            losses_head = [f"loss_{j}" for j in range(k)]
            write_rows(
                self.out / "choices.csv",
                [["round", "kind", "client", "group", *losses_head, "choice"]],
                "w",
            )
            head = ["round", "kind", "group", "clients"]
            head += [f"share_{j}" for j in range(k)] + [f"mean_loss_{j}" for j in range(k)]
            write_rows(self.out / "groups.csv", [head], "w")
        choice = losses.argmin(axis=1)
        rows = [
            [rnd, kind, int(c), int(g), *(f"{v:.6f}" for v in row), int(j)]
            for c, g, row, j in zip(clients, groups, losses, choice, strict=True)
        ]
        write_rows(self.out / "choices.csv", rows, "a")
        write_rows(self.out / "groups.csv", group_rows(rnd, kind, groups, losses), "a")
        if kind == "probe":
            print(f"round {rnd:4d} {describe(groups, losses)}", flush=True)


def write_rows(path: Path, rows: list[list[Any]], mode: str) -> None:
    with open(path, mode, newline="") as f:
        csv.writer(f).writerows(rows)


def group_stats(
    groups: np.ndarray, losses: np.ndarray
) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """Per rotation group of one query: the group, its clients, the share of them
    choosing each model and each model's mean loss."""
    stats = []
    for g in np.unique(groups):
        sel = losses[groups == g]
        share = np.bincount(sel.argmin(axis=1), minlength=losses.shape[1]) / len(sel)
        stats.append((int(g), len(sel), share, sel.mean(axis=0)))
    return stats


def describe(groups: np.ndarray, losses: np.ndarray) -> str:
    """One line: per group, the share choosing each model and each model's mean loss."""
    return " | ".join(
        f"group {g}: chose "
        + "/".join(f"{s:.2f}" for s in share)
        + " loss "
        + "/".join(f"{v:.3f}" for v in mean)
        for g, _, share, mean in group_stats(groups, losses)
    )


def group_rows(rnd: int, kind: str, groups: np.ndarray, losses: np.ndarray) -> list[list[Any]]:
    """groups.csv rows of one query: per group the clients, the share choosing each
    model and each model's mean loss."""
    return [
        [rnd, kind, g, n, *np.round(share, 3), *np.round(mean, 4)]
        for g, n, share, mean in group_stats(groups, losses)
    ]


def instrument(log: ChoiceLog) -> None:
    """Wrap IFCA's decision query and round so that every choice (and the probes) is logged."""
    run_round = IFCA.run_round

    def groups_of(algo: IFCA, clients: np.ndarray) -> np.ndarray:
        truth = algo.ctx.federation.groups
        return np.full(len(clients), -1) if truth is None else truth[clients]

    def logged_losses(
        self: IFCA,
        models: torch.Tensor,
        clients: np.ndarray,
        rnd: int,
        purpose: str,
        *args: Any,
        **kwargs: Any,
    ) -> Replies:
        replies = super(IFCA, self).model_losses(models, clients, rnd, purpose, *args, **kwargs)
        if purpose in ("decide", "probe"):
            kind = "chosen" if purpose == "decide" else "probe"
            losses = replies["losses"].double().numpy()
            log.add(rnd, kind, replies.clients, groups_of(self, replies.clients), losses)
        return replies

    def logged_round(
        self: IFCA, state: ClusterModelState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[ClusterModelState]:
        if (rnd - 1) % log.probe_every == 0:
            clients = np.flatnonzero(self.ctx.present)
            self.model_losses(state.models, clients, rnd, "probe", "all", measurement=True)
        return run_round(self, state, rnd, selected)

    IFCA.model_losses = logged_losses  # type: ignore[method-assign]
    IFCA.run_round = logged_round  # type: ignore[method-assign]


def initializer_on(batches: str) -> None:
    """Make the good initializer judge the initial models on ``batches`` (``one``: the
    behaviour before the fix, which judged them on one mini-batch whatever the choice used)."""
    model_losses = ClusterModelAlgorithm.model_losses

    def patched(self: ClusterModelAlgorithm, *args: Any, **kwargs: Any) -> Any:
        if args[3] == "init":
            args = (*args[:4], batches)
            kwargs.pop("batches", None)
        return model_losses(self, *args, **kwargs)

    ClusterModelAlgorithm.model_losses = patched  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="ifca-rotated-cifar10")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--probe-every", type=int, default=1)
    p.add_argument(
        "--init-batches",
        choices=["one", "all"],
        default=None,
        help="the good initializer's losses on one mini-batch or all data (default: the choice's)",
    )
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("fedcluster").setLevel(logging.INFO)  # the good initializer's draws
    overrides: dict[str, Any] = {"data": {"data_dir": args.data_dir}}
    if args.rounds is not None:
        overrides["rounds"] = args.rounds
    config = resolve_config(None, args.preset, args.sets, overrides, algorithms=["ifca"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = ChoiceLog(out, args.probe_every)
    instrument(log)
    if args.init_batches is not None:
        initializer_on(args.init_batches)
    Experiment(config).run(out / "run", progress=False)


if __name__ == "__main__":
    main()
