"""The round loop: build the federation, run each (algorithm, seed) job, write the run directory.

Run directory (DESIGN "Run directory"): ``config.yaml`` (fully resolved),
``metrics.csv`` (one row per round x algorithm x seed), ``clusters.csv``
(client -> cluster per round, with the true group; −1 for a client not
present), ``events.csv`` (per job and round: faulty clients, joins,
departures, drift, failures and rejections, each with client and detail),
``summary.json`` and ``checkpoints/``. Checkpoints are written atomically
every ``checkpoint_every`` rounds; :func:`resume` continues a killed run so
that ``metrics.csv`` equals that of an uninterrupted run (timing columns
aside): all randomness is derived from (seed, purpose, round, client), so the
rounds after a checkpoint repeat exactly. A dynamic federation
(:mod:`fedcluster.scenario`) is rebuilt on resume: each job drifts its own
copy of the seed's federation, and a resumed job replays the drift events up
to its checkpoint before continuing.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from fedcluster.algorithms import ALGORITHMS, Context
from fedcluster.algorithms.base import Algorithm, Comm, init_row
from fedcluster.config import (
    AlgorithmSpec,
    ExperimentConfig,
    dump_config,
    load_yaml,
    validate_config,
)
from fedcluster.data.drift import DriftPool, apply_drift
from fedcluster.data.federation import Federation, build_federation
from fedcluster.data.partitions import Partition, make_partition
from fedcluster.data.sources import Dataset, load_dataset
from fedcluster.engine.backend import Backend, FederationView
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError
from fedcluster.metrics import COLUMNS, accuracy_columns, cluster_columns, format_row
from fedcluster.models import build_model, check_rows_fit
from fedcluster.privacy import LocalDP, reported_epsilon
from fedcluster.report import format_table, summary_rows
from fedcluster.rng import numpy_rng
from fedcluster.scenario import Scenario

CLUSTER_COLUMNS = ["algorithm", "seed", "round", "client", "cluster", "true_group"]
EVENT_COLUMNS = ["algorithm", "seed", "round", "client", "kind", "detail"]
DIAGNOSTIC_COLUMNS = ["algorithm", "seed", "round", "name", "value"]


def build_federation_for(config: ExperimentConfig, seed: int) -> Federation:
    """Load the dataset and partition it among clients, as the config says, for one seed."""
    return build_federation(*load_partitioned(config, seed))


def load_partitioned(config: ExperimentConfig, seed: int) -> tuple[Dataset, Partition]:
    """The config's dataset and its partition among clients for one seed."""
    data = config.data
    dataset = load_dataset(
        data.dataset, data.data_dir, download=data.download, seed=seed, **data.options
    )
    options = dict(data.partition)
    name = options.pop("name")
    y_test = None if dataset.test is None else dataset.test.y.numpy()
    partition = make_partition(
        name, dataset.train.y.numpy(), y_test, numpy_rng(seed, "partition"), **options
    )
    return dataset, partition


def select_clients(
    n_clients: int,
    config: ExperimentConfig,
    seed: int,
    rnd: int,
    available: np.ndarray | None = None,
) -> np.ndarray:
    """The round's participants: all, a fraction or a count, drawn from (seed, round).

    ``available`` (a mask, default: everyone) limits the draw to the clients
    that can be reached (:mod:`fedcluster.scenario`); a fraction is then a
    fraction of them.
    """
    candidates = np.arange(n_clients) if available is None else np.flatnonzero(available)
    p = config.participation
    if p.fraction is None and p.count is None:
        return candidates
    if p.count is not None and p.count > n_clients:  # once per message (warnings' default)
        warnings.warn(
            f"participation.count {p.count} is above the number of clients {n_clients}; "
            f"every available client takes part",
            stacklevel=2,
        )
    k = p.count if p.count is not None else max(1, round(p.fraction * len(candidates)))
    k = min(k, len(candidates))
    return np.sort(numpy_rng(seed, "participation", rnd).choice(candidates, k, replace=False))


@dataclass
class JobResult:
    """The per-round metric rows of one (algorithm, seed) job."""

    algorithm: str
    seed: int
    rows: list[dict[str, object]]
    wall_seconds: float


class RunDirectory:
    """Reads and writes the files of a run directory, atomically where it matters."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metrics = self.path / "metrics.csv"
        self.clusters = self.path / "clusters.csv"
        self.diagnostics = self.path / "diagnostics.csv"
        self.events = self.path / "events.csv"
        self.checkpoints = self.path / "checkpoints"
        self.artifacts = self.path / "artifacts"

    def create(self, config: ExperimentConfig) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(self.path / "config.yaml", dump_config(config))
        tables = (
            (self.metrics, COLUMNS),
            (self.clusters, CLUSTER_COLUMNS),
            (self.diagnostics, DIAGNOSTIC_COLUMNS),
            (self.events, EVENT_COLUMNS),
        )
        for path, header in tables:
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(header)

    def checkpoint_path(self, label: str, seed: int) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_.=," else "_" for ch in label)
        return self.checkpoints / f"{safe}-seed{seed}.pt"

    def append(self, path: Path, rows: list[list[str]]) -> None:
        with open(path, "a", newline="") as f:
            csv.writer(f).writerows(rows)

    def _rewrite(
        self,
        path: Path,
        keep: Callable[[dict[str, str]], bool],
        order: Callable[[dict[str, str]], tuple] | None = None,
    ) -> None:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            rows = [r for r in reader if keep(r)]
        if order is not None:
            rows.sort(key=order)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)

    def truncate_job(self, label: str, seed: int, after_round: int) -> None:
        """Drop rows of one job beyond ``after_round`` (rows a resumed job will write again)."""

        def keep(r: dict[str, str]) -> bool:
            mine = r["algorithm"] == label and int(r["seed"]) == seed
            return not (mine and int(r["round"]) > after_round)

        for path in (self.metrics, self.clusters, self.diagnostics, self.events):
            self._rewrite(path, keep)

    def sort_rows(self, jobs: list[tuple[str, int]]) -> None:
        """Put rows in job order, then round (resumed jobs append after later jobs' rows)."""
        rank = {(label, seed): i for i, (label, seed) in enumerate(jobs)}

        def order(r: dict[str, str]) -> tuple:
            return (rank.get((r["algorithm"], int(r["seed"])), len(rank)), int(r["round"]))

        for path in (self.metrics, self.clusters, self.diagnostics, self.events):
            self._rewrite(path, lambda r: True, order)

    def save_artifacts(self, label: str, seed: int, arrays: dict[str, np.ndarray]) -> None:
        """Arrays an algorithm keeps at the end of a job, as ``artifacts/<label>-seed<s>.npz``."""
        if not arrays:
            return
        self.artifacts.mkdir(exist_ok=True)
        path = self.artifacts / self.checkpoint_path(label, seed).with_suffix(".npz").name
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_torch_save(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Experiment:
    """A configured experiment: one federation per seed, each algorithm run on it.

    Pass ``model`` (any ``nn.Module``) and/or ``federation`` to use your own
    instead of the config's preset model and dataset.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        model: nn.Module | None = None,
        federation: Federation | None = None,
    ) -> None:
        self.config = config
        self._model = model
        self._federation = federation

    def federation(self, seed: int) -> Federation:
        if self._federation is not None:
            return self._federation
        return build_federation_for(self.config, seed)

    def data(self, seed: int) -> tuple[Federation, DriftPool | None]:
        """The seed's federation and, when a drift redraws samples, the pool it draws from."""
        if not any(d.kind == "redistribute" for d in self.config.scenario.drift):
            return self.federation(seed), None
        if self._federation is not None:
            raise ConfigError(
                "scenario.drift: 'redistribute' redraws samples from the config's dataset; "
                "it is not available for a federation passed in directly"
            )
        dataset, partition = load_partitioned(self.config, seed)
        return build_federation(dataset, partition), DriftPool(dataset, partition)

    def model(self, federation: FederationView) -> nn.Module:
        if self._model is not None:
            return self._model
        m = self.config.model
        model = build_model(m.name, federation.input_shape, federation.n_classes, **m.options)
        check_rows_fit(m.name, model, rows=federation.n_clients + 1)  # uploads + the start
        return model

    def backend(self, model: nn.Module, federation: Federation, seed: int) -> Backend:
        """What runs the client computations: the batched simulator (the Flower
        backend, :mod:`fedcluster.flower.server`, sends them to nodes instead)."""
        return Simulator(model, federation, seed=seed, group_size=self.config.group_size)

    def run(
        self,
        out: str | Path,
        resume: bool = False,
        progress: bool = True,
        stop_after_round: int | None = None,
    ) -> list[JobResult]:
        """Run every job, writing the run directory ``out``.

        With ``resume`` the directory's checkpoints are continued. ``stop_after_round``
        stops each job after that round (used to test resuming).
        """
        rundir = RunDirectory(out)
        if not resume:
            rundir.create(self.config)
        results = []
        for seed in self.config.seeds:
            federation, pool = self.data(seed)
            scenario = Scenario(
                self.config.scenario, federation.n_clients, seed, self.config.rounds
            )
            model = self.model(federation)
            start_row = init_row(model, seed, "init")
            for spec in self.config.algorithms:
                results.append(
                    self._run_job(
                        rundir,
                        spec,
                        seed,
                        federation,
                        model,
                        start_row,
                        resume,
                        progress,
                        stop_after_round,
                        (scenario, pool),
                    )
                )
        if resume:
            rundir.sort_rows([(j.algorithm, j.seed) for j in results])
        write_summary(rundir.path, self.config, results)
        return results

    def _run_job(
        self,
        rundir: RunDirectory,
        spec: AlgorithmSpec,
        seed: int,
        federation: Federation,
        model: nn.Module,
        start_row: torch.Tensor,
        resume: bool,
        progress: bool,
        stop_after_round: int | None,
        dynamics: tuple[Scenario, DriftPool | None],
    ) -> JobResult:
        cfg = self.config
        label = spec.display_name()
        scenario, pool = dynamics
        if scenario.has_drift:  # each job drifts its own copy of the seed's federation
            federation = federation.clone()
        sim = self.backend(model, federation, seed)
        ctx = Context(
            sim=sim,
            train=cfg.train.local(),
            seed=seed,
            init_row=start_row,
            comm=Comm(),
            bound=cfg.rejection.bound(),
            aggregate=cfg.aggregation.aggregator(),
        )
        privacy = LocalDP.install(ctx, cfg)  # local DP (None without a privacy section)
        faulty = scenario.upload_transform()
        if faulty is not None:  # after local DP: a faulty client garbles whatever it would send
            ctx.client_transforms.append(faulty)
        algorithm: Algorithm = ALGORITHMS[spec.name](spec.build_params(), ctx)
        ckpt_path = rundir.checkpoint_path(label, seed)
        first_round, state, rows, wall = 1, None, [], 0.0
        if resume and ckpt_path.exists():
            ckpt = torch.load(ckpt_path, weights_only=False)
            state, first_round, rows, wall = (
                ckpt["state"],
                ckpt["round"] + 1,
                ckpt["rows"],
                ckpt["wall_seconds"],
            )
            rundir.truncate_job(label, seed, ckpt["round"])
            if privacy is not None:
                privacy.load_state_dict(ckpt.get("privacy"))
        elif resume:
            rundir.truncate_job(label, seed, 0)
        for event in scenario.drifts_through(first_round - 1):  # the data at the checkpoint
            apply_drift(federation, event, pool)
        ctx.set_masks(*scenario.masks(first_round))
        if state is None:
            state = algorithm.init_state()
        last = cfg.rounds if stop_after_round is None else min(cfg.rounds, stop_after_round)
        bar = tqdm(
            range(first_round, last + 1),
            desc=f"{label} seed {seed}",
            disable=not progress,
            leave=True,
            unit="round",
            dynamic_ncols=True,
        )
        started = time.perf_counter() - wall
        for rnd in bar:
            row = self._round(algorithm, state, rnd, seed, label, rundir, dynamics)
            rows.append(row)
            if not math.isnan(row["accuracy"]):
                bar.set_postfix(acc=f"{row['accuracy']:.3f}", refresh=False)
            if rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds:
                _atomic_torch_save(
                    {
                        "round": rnd,
                        "state": state,
                        "rows": rows,
                        "wall_seconds": time.perf_counter() - started,
                        "privacy": None if privacy is None else privacy.state_dict(),
                    },
                    ckpt_path,
                )
        bar.close()
        if last == cfg.rounds:
            rundir.save_artifacts(label, seed, algorithm.artifacts(state))
        return JobResult(label, seed, rows, time.perf_counter() - started)

    def _round(
        self,
        algorithm: Algorithm,
        state: dict,
        rnd: int,
        seed: int,
        label: str,
        rundir: RunDirectory,
        dynamics: tuple[Scenario, DriftPool | None],
    ) -> dict[str, object]:
        cfg = self.config
        ctx = algorithm.ctx
        federation = ctx.sim.federation
        events = start_round(ctx, rnd, *dynamics)
        client_before = ctx.sim.seconds
        t0 = time.perf_counter()
        selected = select_clients(federation.n_clients, cfg, seed, rnd, ctx.available)
        loss = algorithm.run_round(state, rnd, selected) if len(selected) else math.nan
        round_seconds = time.perf_counter() - t0
        client_seconds = ctx.sim.seconds - client_before
        row: dict[str, object] = {
            "round": rnd,
            "algorithm": label,
            "seed": seed,
            "loss": loss,
            "bytes_up": ctx.comm.up,
            "bytes_down": ctx.comm.down,
            "rejected": len(ctx.rejected),
            "failed": len(ctx.failed),
            "epsilon": reported_epsilon(ctx),
            "client_seconds": client_seconds,
            "server_seconds": round_seconds - client_seconds,
        }
        assign = algorithm.clusters(state)
        if assign is not None:  # clients not (or no longer) in the federation: unassigned
            assign = np.where(ctx.present, assign, -1)
        row.update(cluster_columns(assign, federation.groups))
        t1 = time.perf_counter()
        if ctx.present.any() and (rnd % cfg.eval_every == 0 or rnd == cfg.rounds):
            row.update(accuracy_columns(algorithm.evaluate(state, rnd)))
        else:
            row.update(
                accuracy=math.nan, accuracy_mean=math.nan, accuracy_std=math.nan, test_loss=math.nan
            )
        row["eval_seconds"] = time.perf_counter() - t1
        rundir.append(rundir.metrics, [format_row(row)])
        events += ctx.events
        if events:
            rundir.append(rundir.events, [[label, seed, rnd, *event] for event in events])
        diagnostics = algorithm.diagnostics(state)
        if diagnostics:
            rundir.append(
                rundir.diagnostics,
                [[label, seed, rnd, k, repr(float(v))] for k, v in diagnostics.items()],
            )
        if assign is not None:
            groups = federation.groups
            rundir.append(
                rundir.clusters,
                [
                    [label, seed, rnd, c, int(assign[c]), "" if groups is None else int(groups[c])]
                    for c in range(federation.n_clients)
                ],
            )
        return row


def start_round(
    ctx: Context, rnd: int, scenario: Scenario, pool: DriftPool | None
) -> list[tuple[int, str, str]]:
    """Prepare round ``rnd`` of a job: the scenario's masks in ``ctx``, the round's drift applied.

    Returns the round's scenario events ``(client, kind, detail)`` for
    ``events.csv``: the faulty clients (round 1), joins, departures and drift.
    """
    ctx.start_round(*scenario.masks(rnd))
    events = [(c, "faulty", fault) for c, fault in scenario.faulty()] if rnd == 1 else []
    events += [(int(c), "join", "") for c in scenario.joins(rnd)]
    events += [(int(c), "leave", "") for c in scenario.leaves(rnd)]
    for event in scenario.drifts(rnd):
        detail = apply_drift(ctx.sim.federation, event, pool)
        events.append((event.client, "drift", f"{event.kind}: {detail}"))
    return events


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if isinstance(v, float) and not math.isnan(v)]


def job_summary(job: JobResult) -> dict[str, object]:
    """Final and best accuracy, final purity, rounds to 0.9 purity, bytes and time of a job."""
    accs = _finite([r["accuracy"] for r in job.rows])
    last = job.rows[-1] if job.rows else {}
    purity_round = next(
        (r["round"] for r in job.rows if isinstance(r.get("purity"), float) and r["purity"] >= 0.9),
        None,
    )
    return {
        "algorithm": job.algorithm,
        "seed": job.seed,
        "rounds": len(job.rows),
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "final_accuracy_mean": last.get("accuracy_mean"),
        "final_accuracy_std": last.get("accuracy_std"),
        "final_purity": None if _nan(last.get("purity")) else last.get("purity"),
        "rounds_to_purity_0.9": purity_round,
        "bytes_up": int(sum(r["bytes_up"] for r in job.rows)),
        "bytes_down": int(sum(r["bytes_down"] for r in job.rows)),
        "wall_seconds": job.wall_seconds,
    }


def _nan(v: object) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def write_summary(path: Path, config: ExperimentConfig, results: list[JobResult]) -> None:
    """``summary.json`` (per-job summaries, NaN as null) and ``summary.md`` (the table)."""
    jobs = [{k: None if _nan(v) else v for k, v in job_summary(j).items()} for j in results]
    text = json.dumps({"name": config.name, "jobs": jobs}, indent=2, allow_nan=False)
    _atomic_write_text(path / "summary.json", text)
    _atomic_write_text(path / "summary.md", format_table(summary_rows(jobs)) + "\n")


def resume(
    out: str | Path,
    progress: bool = True,
    experiment_factory: Callable[[ExperimentConfig], Experiment] = Experiment,
) -> list[JobResult]:
    """Continue a killed run from its checkpoints, with its own resolved config."""
    path = Path(out)
    config = validate_config(load_yaml(path / "config.yaml"))
    return experiment_factory(config).run(path, resume=True, progress=progress)
