"""IFCA's cluster choices round by round (issue 24, item 2: why IFCA's rotated CIFAR-10
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

    python -m benchmarks.ifca_cifar_diag --preset ifca-rotated-cifar10 --rounds 3 \\
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

from benchmarks.common import default_data_dir
from fedcluster.algorithms.cluster_models import Choice, ClusterModelAlgorithm, ClusterModelState
from fedcluster.algorithms.ifca import IFCA
from fedcluster.config import resolve_config
from fedcluster.runner import Experiment


class ChoiceLog:
    """Collects IFCA's per-client losses and choices; writes the two CSV tables."""

    def __init__(self, out: Path, probe_every: int) -> None:
        self.out = out
        self.probe_every = probe_every
        self.rows: list[dict[str, Any]] = []

    def add(
        self, rnd: int, kind: str, clients: np.ndarray, groups: np.ndarray, losses: np.ndarray
    ) -> None:
        choice = losses.argmin(axis=1)
        for c, g, row, k in zip(clients, groups, losses, choice, strict=True):
            rec = {"round": rnd, "kind": kind, "client": int(c), "group": int(g)}
            rec.update({f"loss_{j}": float(v) for j, v in enumerate(row)})
            rec["choice"] = int(k)
            self.rows.append(rec)
        if kind == "probe":
            print(f"round {rnd:4d} {describe(groups, losses)}", flush=True)
        self.write()

    def write(self) -> None:
        if not self.rows:
            return
        with open(self.out / "choices.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(self.rows[0]))
            w.writeheader()
            w.writerows(self.rows)
        with open(self.out / "groups.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerows(group_table(self.rows))


def describe(groups: np.ndarray, losses: np.ndarray) -> str:
    """One line: per group, the share choosing each model and each model's mean loss."""
    parts = []
    for g in np.unique(groups):
        sel = losses[groups == g]
        share = np.bincount(sel.argmin(axis=1), minlength=losses.shape[1]) / len(sel)
        parts.append(
            f"group {g}: chose "
            + "/".join(f"{s:.2f}" for s in share)
            + " loss "
            + "/".join(f"{v:.3f}" for v in sel.mean(axis=0))
        )
    return " | ".join(parts)


def group_table(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """groups.csv: per (round, kind, group) the clients, share choosing each model, mean losses."""
    k = sum(1 for key in rows[0] if key.startswith("loss_"))
    head = ["round", "kind", "group", "clients"]
    head += [f"share_{j}" for j in range(k)] + [f"mean_loss_{j}" for j in range(k)]
    table: list[list[Any]] = [head]
    keys = sorted({(r["round"], r["kind"], r["group"]) for r in rows})
    for rnd, kind, g in keys:
        sel = [r for r in rows if (r["round"], r["kind"], r["group"]) == (rnd, kind, g)]
        share = np.bincount([r["choice"] for r in sel], minlength=k) / len(sel)
        mean = [np.mean([r[f"loss_{j}"] for r in sel]) for j in range(k)]
        table.append([rnd, kind, g, len(sel), *np.round(share, 3), *np.round(mean, 4)])
    return table


def instrument(log: ChoiceLog) -> None:
    """Wrap IFCA's round and choice so that every choice (and the probes) is logged."""
    choose = IFCA.choose
    run_round = IFCA.run_round

    def groups_of(algo: IFCA, clients: np.ndarray) -> np.ndarray:
        truth = algo.ctx.federation.groups
        return np.full(len(clients), -1) if truth is None else truth[clients]

    def logged_choose(
        self: IFCA, state: ClusterModelState, rnd: int, selected: np.ndarray
    ) -> Choice:
        replies = self.model_losses(state.models, selected, rnd, "decide", self.choice_batches())
        chosen = choose(self, state, rnd, selected)
        losses = replies["losses"].double().numpy()
        log.add(rnd, "chosen", replies.clients, groups_of(self, replies.clients), losses)
        return chosen

    def logged_round(self: IFCA, state: ClusterModelState, rnd: int, selected: np.ndarray) -> float:
        if (rnd - 1) % log.probe_every == 0:
            clients = np.flatnonzero(self.ctx.present)
            replies = self.model_losses(
                state.models, clients, rnd, "probe", "all", measurement=True
            )
            losses = replies["losses"].double().numpy()
            log.add(rnd, "probe", replies.clients, groups_of(self, replies.clients), losses)
        return run_round(self, state, rnd, selected)

    IFCA.choose = logged_choose  # type: ignore[method-assign]
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
