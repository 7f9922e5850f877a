"""The round loop: build the federation, run each (algorithm, seed) job, call the callbacks.

The loop itself only runs rounds: it sets up each job (backend, channel,
local DP, the scenario's faulty clients), runs the algorithm's round,
measures it, and hands the round to the callbacks (:mod:`fedcluster.experiment.callbacks`).
Writing the run directory (:mod:`fedcluster.experiment.rundir`), checkpoints, the
progress bar and the summary are callbacks; a user adds their own with
``Experiment(config, callbacks=[...])`` (docs/architecture.md).

Checkpoints are written every ``checkpoint_every`` rounds; :func:`resume` continues a killed run so
that ``metrics.csv`` equals that of an uninterrupted run (timing columns
aside): all randomness is derived from (seed, purpose, round, client), so the
rounds after a checkpoint repeat exactly. A dynamic federation
(:mod:`fedcluster.experiment.scenario`) is rebuilt on resume: each job drifts its own
copy of the seed's federation, and a resumed job replays the drift events up
to its checkpoint before continuing.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn

from fedcluster.algorithms import Context, algorithm_class, algorithm_params, check_algorithms
from fedcluster.algorithms.base import Algorithm, State, auto_k, init_row
from fedcluster.algorithms.cluster_count import select_k
from fedcluster.algorithms.robust import Aggregator
from fedcluster.config.schema import (
    AlgorithmSpec,
    ExperimentConfig,
    load_yaml,
    validate_config,
    with_execution,
)
from fedcluster.data.configured import build_federation_for, load_partitioned
from fedcluster.data.drift import DriftEvent, DriftPool, apply_drift, moved_group
from fedcluster.data.federation import Federation
from fedcluster.data.screen import check_given, screen_clients
from fedcluster.engine.device import resolve_device
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.modes import LossFn, resolve_loss
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.experiment import health
from fedcluster.experiment.callbacks import Callback, JobInfo, RunInfo
from fedcluster.experiment.capacity import check_batch_plans, check_cluster_counts
from fedcluster.experiment.client_results import client_records
from fedcluster.experiment.jobs import picklable, run_jobs, threads_per_job
from fedcluster.experiment.metrics import accuracy_columns, cluster_columns, honest_accuracy
from fedcluster.experiment.provenance import data_record, run_record
from fedcluster.experiment.rebuild import check_rebuildable, record_given
from fedcluster.experiment.rundir import (
    Checkpoint,
    JobResult,
    RunDirectory,
    check_resumable,
    load_checkpoint,
    run_directory_callbacks,
)
from fedcluster.experiment.scenario import Scenario, flip_labels
from fedcluster.models import (
    ModelContractError,
    build_model,
    check_model_contract,
    check_rows_fit,
    check_trainable,
)
from fedcluster.privacy.central import CentralDP, check_secure_aggregation
from fedcluster.privacy.ledger import LocalDP, reported_epsilon
from fedcluster.privacy.private_start import planned_start_releases
from fedcluster.protocol.backend import Backend, FederationView
from fedcluster.protocol.batches import LocalTraining
from fedcluster.protocol.channel import UpdateBound
from fedcluster.rng import numpy_rng

log = logging.getLogger("fedcluster")


def kept_row(model: nn.Module | None, init: str) -> torch.Tensor | None:
    """The initial row of a model passed from Python: its own weights with ``init: keep``
    (a CPU copy, taken once: what the run does later cannot change it); ``None`` when
    the run initialises it from the seed (``reset``, or no model given)."""
    if model is None or init == "reset":
        return None
    return ParamLayout(model).flatten().cpu().clone()


def model_for(config: ExperimentConfig, federation: FederationView) -> nn.Module:
    """The config's model for the federation's data shape and classes."""
    m = config.model
    return build_model(m.name, federation.input_shape, federation.n_classes, **m.options)


def simulator_for(
    config: ExperimentConfig,
    model: nn.Module,
    federation: Federation,
    seed: int,
    loss: LossFn | None = None,
    **options: Any,
) -> Simulator:
    """The simulator of ``federation`` with the config's loss (``loss``, a callable
    given from Python, replaces ``train.loss``) and its buffers' treatment; the model
    is first checked on two of the federation's samples (:func:`check_model_contract`)."""
    check_model_contract(model, federation.x_train[:2], federation.n_classes, "model")
    return Simulator(
        model,
        federation,
        seed=seed,
        group_size=config.group_size,
        loss=resolve_loss(config.train.loss) if loss is None else loss,
        local_buffers=config.model.buffers == "local",
        precision=config.precision,
        vmap=config.vmap,
        **options,
    )


def select_clients(
    n_clients: int,
    config: ExperimentConfig,
    seed: int,
    rnd: int,
    available: np.ndarray | None = None,
) -> np.ndarray:
    """The round's participants: all, a fraction or a count, drawn from (seed, round).

    ``available`` (a mask, default: everyone) limits the draw to the clients
    that can be reached (:mod:`fedcluster.experiment.scenario`); a fraction is then a
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
    if p.count is not None:
        k = min(p.count, len(candidates))
    else:
        assert p.fraction is not None
        k = min(max(1, round(p.fraction * len(candidates))), len(candidates))
    return np.sort(numpy_rng(seed, "participation", rnd).choice(candidates, k, replace=False))


class Experiment:
    """A configured experiment: one federation per seed, each algorithm run on it.

    Pass ``model`` (any ``nn.Module``) and/or ``federation`` to use your own
    instead of the config's preset model and dataset, ``loss`` (a
    :data:`~fedcluster.engine.modes.LossFn`) instead of ``train.loss``, ``callbacks``
    (:class:`~fedcluster.experiment.callbacks.Callback`) to follow or stop the rounds, and
    ``backend_factory`` to run the client computations elsewhere than in the
    simulator (the Flower server passes its own, :mod:`fedcluster.flower.server`).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        model: nn.Module | None = None,
        federation: Federation | None = None,
        callbacks: Sequence[Callback] = (),
        backend_factory: BackendFactory | None = None,
        loss: LossFn | None = None,
    ) -> None:
        check_algorithms(config)
        check_secure_aggregation(config)
        # config.yaml: how to rebuild the model, the data and the loss
        self.config = record_given(config, model, federation, loss)
        self._model = model
        if model is not None:
            check_trainable(model, "model")
        self._kept = kept_row(model, config.model.init)
        self._federation = (
            None
            if federation is None
            else screen_clients(check_given(federation), config.data.bad_clients)
        )
        self.callbacks = list(callbacks)
        if loss is not None and backend_factory is not None:
            raise ConfigError(
                "loss: a loss given from Python runs on the simulator only; "
                "name it by import path in train.loss for other backends"
            )
        self.backend_factory = backend_factory or default_factory(config, loss)

    def federation(self, seed: int) -> FederationView:
        if self._federation is not None:
            return self._federation
        return self.backend_factory.federation(seed)

    def data(self, seed: int) -> tuple[FederationView, DriftPool | None]:
        """The seed's federation and, when a drift redraws samples, the pool it draws from."""
        if not any(d.kind == "redistribute" for d in self.config.scenario.drift):
            return self.federation(seed), None
        if self._federation is not None or self.config.data.federation is not None:
            raise ConfigError(
                "scenario.drift: 'redistribute' redraws samples from the config's dataset; "
                "it is not available for a federation passed in directly"
            )
        data = load_partitioned(self.config, seed)
        # the pool follows the partition's client numbering: a bad client refuses the run
        federation = screen_clients(data.federation(), "refuse")
        return federation, DriftPool(data.dataset, data.partition)

    def model(self, federation: FederationView) -> nn.Module:
        if self._model is not None:
            return self._model
        model = model_for(self.config, federation)
        check_trainable(model, f"model.name {self.config.model.name!r}")
        check_rows_fit(self.config.model.name, model, rows=federation.n_clients + 1)
        return model

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
        device = resolve_device(self.config.device)  # fails before the run directory exists
        rundir = RunDirectory(out)
        try:
            with rundir.lock() if resume else rundir.claim():
                return self._run(rundir, resume, progress, stop_after_round, device)
        finally:
            close = getattr(self.backend_factory, "close", None)
            if close is not None:  # a backend with processes of its own (distributed)
                close()

    def _run(
        self,
        rundir: RunDirectory,
        resume: bool,
        progress: bool,
        stop_after_round: int | None,
        device: torch.device,
    ) -> list[JobResult]:
        cfg = self.config
        record = run_record(self.backend_factory.name)
        if not resume:
            rundir.create(cfg, record)
        last = cfg.rounds if stop_after_round is None else min(cfg.rounds, stop_after_round)
        callbacks = [*run_directory_callbacks(rundir, cfg, last, progress), *self.callbacks]
        run = RunInfo(rundir.path, cfg, resume, record)
        for callback in callbacks:
            callback.on_run_start(run)
        if cfg.jobs > 1:
            for seed in cfg.seeds:  # the workers build each seed's data; record it here
                self.record_data(rundir, record, seed, self.data(seed)[0], resume)
            results = self._run_parallel(run, last, device, progress)
            rundir.sort_rows([(r.algorithm, r.seed) for r in results])
        else:
            results = []
            for seed in cfg.seeds:
                setting, dynamics = self.seed_setting(seed, device, rundir, record, resume)
                for spec in cfg.algorithms:
                    job = Job(self, run, spec, seed, setting, dynamics)
                    results.append(job.run(rundir, resume, last, callbacks))
        for callback in callbacks:
            callback.on_run_end(run, results)
        return results

    def _run_parallel(
        self, run: RunInfo, last: int, device: torch.device, progress: bool
    ) -> list[JobResult]:
        """Every job over ``config.jobs`` worker processes (:mod:`fedcluster.experiment.jobs`);
        the results in the sequential order (seed, then algorithm entry)."""
        cfg = self.config
        if not isinstance(self.backend_factory, SimulatorFactory):
            raise ConfigError(
                "jobs: jobs run in parallel on the simulator backend only (backend: simulator)"
            )
        order = [(seed, i) for seed in cfg.seeds for i in range(len(cfg.algorithms))]
        n = min(cfg.jobs, len(order))
        given = picklable(self._model, self._federation, self.backend_factory.loss, self.callbacks)
        threads = (threads_per_job(n), torch.get_num_threads())
        task = JobTask(cfg, *given, run.path, run.resume, last, device, threads)
        labels = [spec.display_name() for spec in cfg.algorithms]
        return run_jobs(task, order, n, labels, run.path, progress)

    def record_data(
        self,
        rundir: RunDirectory,
        record: dict[str, Any],
        seed: int,
        federation: FederationView,
        resume: bool,
    ) -> None:
        """Add the data seed ``seed`` uses to the run's ``record`` and to config.yaml (a
        resumed run's config.yaml stays as its checkpoints knew it)."""
        record["data"].append(data_record(self.config, seed, federation))
        if not resume:
            rundir.write_config(self.config, record)

    def seed_setting(
        self,
        seed: int,
        device: torch.device,
        rundir: RunDirectory | None = None,
        record: dict[str, Any] | None = None,
        resume: bool = False,
    ) -> tuple[tuple[FederationView, nn.Module, torch.Tensor], tuple[Scenario, DriftPool | None]]:
        """What every job of a seed starts from: (federation on ``device``, model, initial
        row) and (the seed's scenario, the drift's sample pool); with ``rundir`` and
        ``record``, the data is recorded (:meth:`record_data`)."""
        federation, pool = self.data(seed)
        if rundir is not None and record is not None:
            self.record_data(rundir, record, seed, federation, resume)
        if isinstance(federation, Federation):  # the nodes hold the data on Flower
            federation = federation.to(device)
        setting, scenario = self.setting(federation, seed)
        return setting, (scenario, pool)

    def setting(
        self, federation: FederationView, seed: int
    ) -> tuple[tuple[FederationView, nn.Module, torch.Tensor], Scenario]:
        """What every job of a seed shares: (federation, model, initial row), and the
        seed's scenario."""
        cfg = self.config
        check_cluster_counts(cfg, federation.n_clients)
        check_batch_plans(cfg, federation.train_sizes)
        model = self.model(federation)
        scenario = Scenario(cfg.scenario, federation.n_clients, seed, cfg.rounds)
        start = init_row(model, seed, "init") if self._kept is None else self._kept.clone()
        return (federation, model, start), scenario


class BackendFactory(Protocol):
    """Where a job's client computations run: the federation the server sees and its backend."""

    name: str
    """The backend's name in the run's record (:mod:`fedcluster.experiment.provenance`)."""

    def federation(self, seed: int) -> FederationView: ...

    def backend(self, model: nn.Module, federation: FederationView, seed: int) -> Backend: ...


class SimulatorFactory:
    """The batched simulator over the config's dataset and partition (the default).

    ``threads`` fixes the simulator's worker threads (default: torch's thread count); a
    job of a parallel run passes its driver's count, so that the MLP kernel forms the
    same client groups as the sequential run (:func:`~fedcluster.engine.kernel_training.
    balanced_group_size`): a client's float rounding depends on its group's shapes.
    """

    name = "simulator"

    def __init__(
        self, config: ExperimentConfig, loss: LossFn | None = None, threads: int | None = None
    ) -> None:
        self.config = config
        self.loss = loss
        self.threads = threads

    def federation(self, seed: int) -> Federation:
        return build_federation_for(self.config, seed)

    def backend(self, model: nn.Module, federation: FederationView, seed: int) -> Backend:
        assert isinstance(federation, Federation)
        options = {} if self.threads is None else {"threads": self.threads}
        return simulator_for(self.config, model, federation, seed, loss=self.loss, **options)


def default_factory(config: ExperimentConfig, loss: LossFn | None = None) -> BackendFactory:
    """The config's backend: the simulator in this process, or sharded over workers."""
    if config.backend == "distributed":
        from fedcluster.experiment.distributed import DistributedFactory

        return DistributedFactory(config, loss)
    return SimulatorFactory(config, loss)


class Job:
    """One (algorithm, seed) job: its channel, algorithm and dynamics, run round by round."""

    def __init__(
        self,
        experiment: Experiment,
        run: RunInfo,
        spec: AlgorithmSpec,
        seed: int,
        setting: tuple[FederationView, nn.Module, torch.Tensor],
        dynamics: tuple[Scenario, DriftPool | None],
    ) -> None:
        cfg = experiment.config
        federation, model, start_row = setting
        self.config = cfg
        self.scenario, self.pool = dynamics
        if self.scenario.has_drift and isinstance(federation, Federation):
            federation = federation.clone()  # each job drifts its own copy of the seed's data
        if self.scenario.regroups and federation.groups is not None:
            # moved per job; both views (Federation, Flower's FederationInfo) are dataclasses
            federation = replace(cast(Any, federation), groups=federation.groups.copy())
        flippers = self.scenario.label_flippers()
        if len(flippers) and isinstance(federation, Federation):
            federation = flip_labels(federation, flippers)  # where they train (Flower: the node)
        self.backend = experiment.backend_factory.backend(model, federation, seed)
        self.privacy = LocalDP.from_config(cfg, federation.train_sizes, seed)
        starts = planned_start_releases(spec.params)
        self.central = CentralDP.from_config(
            cfg, federation.n_clients, len(start_row), seed, starts
        )
        ctx = Context.for_backend(
            self.backend,
            LocalTraining(**cfg.train.model_dump(exclude={"loss"})),
            seed,
            start_row,
            self.privacy,
            UpdateBound(**cfg.rejection.model_dump()),
        )
        ctx.model_choice = cfg.evaluation.model_choice
        ctx.compare = cfg.model.compare
        self.channel = ctx.channel
        ctx.aggregate = Aggregator(
            **cfg.aggregation.model_dump(), round_norms=lambda: self.channel.update_norms
        )
        if self.central is not None:
            ctx.aggregate = ctx.central = self.central
            ctx.secure = cfg.privacy.secure_aggregation
        faulty = self.scenario.upload_transform()
        if faulty is not None:  # after local DP: a faulty client garbles whatever it would send
            self.channel.client_transforms.append(faulty)
        self.spec, self.ctx = spec, ctx
        self.auto = auto_k(spec)  # n_clusters: auto: the algorithm is built once K is chosen
        self.algorithm: Algorithm
        if self.auto is None:
            self._build(None)
        self.info = JobInfo(run, spec.display_name(), seed, privacy=self.privacy or self.central)
        self._keep_traffic = False  # init_state's traffic, kept for the first round
        self._warnings: list[tuple[int, str, str]] = []  # the K choice's, for round 1
        self.info.groups = federation.groups

    def run(
        self, rundir: RunDirectory, resume: bool, last: int, callbacks: list[Callback]
    ) -> JobResult:
        info = self.info
        resumed = resume and rundir.checkpoint_path(info.label, info.seed).exists()
        if self.auto is not None and not resumed:
            self._choose_k(rundir)  # a resumed job's K is read back with its checkpoint
        state = self._restore(rundir) if resume else None
        for event in self.scenario.drifts_through(info.first_round - 1):  # data at the checkpoint
            self._drift(event)
        self.channel.set_masks(*self.scenario.masks(info.first_round))
        if state is None:
            state = self.algorithm.init_state()  # its requests count in the first round
            self._keep_traffic = True
        for callback in callbacks:
            callback.on_job_start(info)
        started = time.perf_counter() - info.wall_offset
        for rnd in range(info.first_round, last + 1):
            row, state = self._round(state, rnd)
            info.rows.append(row)
            stop = [callback.on_round_end(info, rnd, row, state) for callback in callbacks]
            if any(stop):
                break
            if self.privacy is not None and self.privacy.exhausted() and rnd < last:
                log.warning(
                    "%s seed %d: every client has spent its privacy budget after round %d; "
                    "the job stops here (privacy.max_participations allows no more uploads)",
                    info.label,
                    info.seed,
                    rnd,
                )
                break
        result = JobResult(info.label, info.seed, info.rows, time.perf_counter() - started)
        if last == self.config.rounds:
            rundir.save_artifacts(info.label, info.seed, self.algorithm.artifacts(state))
        for callback in callbacks:
            callback.on_job_end(info, result)
        return result

    def _build(self, k: int | None) -> None:
        """The job's algorithm; ``k`` replaces an ``auto`` number of clusters."""
        self.algorithm = algorithm_class(self.spec.name)(algorithm_params(self.spec, k=k), self.ctx)

    def _choose_k(self, rundir: RunDirectory) -> None:
        """Build the algorithm with the K a warm-up chooses
        (:mod:`fedcluster.algorithms.cluster_count`);
        the warm-up's traffic counts in round 1 and its curve goes to ``select_k.csv``."""
        assert self.auto is not None
        label, seed = self.info.label, self.info.seed
        self.channel.set_masks(*self.scenario.masks(1))
        k, curve = select_k(self.ctx, self.auto, np.flatnonzero(self.channel.available))
        rundir.save_k_curve(label, seed, self.auto.field, curve, k)
        log.info("%s seed %d: %s = %d (silhouette %s)", label, seed, self.auto.field, k, curve)
        self._warn(health.near_tie(curve, k))
        self._build(k)

    def _warn(self, line: str | None) -> None:
        """Log a warning of :mod:`fedcluster.experiment.health` and keep it for ``events.csv``."""
        if line is not None:
            log.warning("%s seed %d: %s", self.info.label, self.info.seed, line)
            self._warnings.append((health.NO_CLIENT, health.WARNING, line))

    def checkpointed(self, rundir: RunDirectory) -> tuple[Checkpoint, State] | None:
        """The job's checkpoint in ``rundir`` and the server state it holds, checked
        against the run's config (None: the job has no checkpoint). An ``auto`` job's
        algorithm is built with the K ``select_k.csv`` records."""
        info = self.info
        path = rundir.checkpoint_path(info.label, info.seed)
        if not path.exists():
            return None
        if self.auto is not None:
            k = rundir.chosen_k(info.label, info.seed)
            if k is None:
                raise FedclusterError(
                    f"{rundir.select_k}: no chosen K for {info.label} seed {info.seed} "
                    f"({self.auto.field}: auto); its checkpoint {path.name} needs it"
                )
            self._build(k)
        ckpt = load_checkpoint(path)
        ckpt.check(path, info.label, info.seed, self.config)
        try:
            state = self.algorithm.StateType.from_record(ckpt.state)
        except (KeyError, TypeError, ValueError) as exc:
            raise FedclusterError(
                f"{path}: {exc}; delete it to restart that job from round 1"
            ) from None
        return ckpt, state

    def _restore(self, rundir: RunDirectory) -> State | None:
        """The checkpointed state of a resumed job (``None``: start afresh), its rows
        and round; the run directory's tables cut back to the checkpoint."""
        info = self.info
        found = self.checkpointed(rundir)
        if found is None:
            rundir.rebuild_job(info.label, info.seed, {}, through=0)
            return None
        ckpt, state = found
        info.first_round = ckpt.round + 1
        info.rows = ckpt.rows
        info.wall_offset = ckpt.wall_seconds
        info.restored = ckpt
        lines = ckpt.lines(rundir, info.label, info.seed, info.groups)
        repaired = rundir.rebuild_job(info.label, info.seed, lines, through=ckpt.round)
        if repaired:
            log.warning(
                "resume: %s seed %d: rebuilt %s from its checkpoint (round %d); "
                "rows that had been edited, cut or deleted are restored",
                info.label,
                info.seed,
                ", ".join(repaired),
                ckpt.round,
            )
        if self.info.privacy is not None:
            self.info.privacy.load_state_dict(ckpt.privacy)
        return state

    def _round(self, state: State, rnd: int) -> tuple[dict[str, object], State]:
        """Run and measure round ``rnd``: its metrics row and the new state; the round's
        records go to ``self.info``."""
        cfg, info, channel, algorithm = self.config, self.info, self.channel, self.algorithm
        federation = self.backend.federation
        events = self._start_round(rnd)
        client_before = self.backend.seconds
        t0 = time.perf_counter()
        selected = select_clients(federation.n_clients, cfg, info.seed, rnd, channel.available)
        if self.central is not None:
            self.central.start_round(rnd)
        out = algorithm.run_round(state, rnd, selected) if len(selected) else None
        state = state if out is None else out.state
        if self.central is not None:
            self.central.end_round()
        round_seconds = time.perf_counter() - t0
        client_seconds = self.backend.seconds - client_before
        row: dict[str, object] = {
            "round": rnd,
            "algorithm": info.label,
            "seed": info.seed,
            "loss": math.nan if out is None else out.loss,
            "bytes_up": channel.traffic.up,
            "bytes_down": channel.traffic.down,
            "rejected": len(channel.rejected),
            "failed": len(channel.failed),
            "epsilon": reported_epsilon(self.info.privacy),
            "client_seconds": client_seconds,
            "server_seconds": round_seconds - client_seconds,
        }
        assign = algorithm.clusters(state)
        if assign is not None:  # clients not (or no longer) in the federation: unassigned
            assign = np.where(channel.present, assign, -1)
        row.update(cluster_columns(assign, federation.groups))
        t1 = time.perf_counter()
        honest: dict[str, float] = {}
        info.client_results = []
        if channel.present.any() and (rnd % cfg.eval_every == 0 or rnd == cfg.rounds):
            result = algorithm.evaluate(state, rnd)
            row.update(accuracy_columns(result))
            honest = honest_accuracy(result, self.scenario.fault < 0)
            info.client_results = client_records(
                info.label, info.seed, rnd, result, assign, federation.groups
            )
        else:
            row.update(
                accuracy=math.nan, accuracy_mean=math.nan, accuracy_std=math.nan, test_loss=math.nan
            )
        row["eval_seconds"] = time.perf_counter() - t1
        if assign is not None and rnd == cfg.rounds:
            self._warn(health.one_cluster(assign, channel.present))
        info.events = events + channel.events + self._end_round(rnd) + self._warnings
        self._warnings = []
        info.clusters = assign
        info.diagnostics = {**({} if out is None else out.diagnostics), **honest}
        return row, state

    def _start_round(self, rnd: int) -> list[tuple[int, str, str]]:
        """Set the scenario's masks and apply the round's drift; the scenario's events
        ``(client, kind, detail)``: faulty clients (round 1), joins, departures, drift,
        and the backend's own (Flower: clients whose node came back or connected). A
        client the backend cannot reach this round is not available for selection."""
        scenario = self.scenario
        present, available, failing = scenario.masks(rnd)
        start = getattr(self.backend, "start_round", None)
        found: list[tuple[int, str, str]] = []
        if start is not None:  # a backend that learns who it reaches (Flower: lost, back nodes)
            reachable, found = start(rnd)
            available = available & reachable
        self.channel.start_round(present, available, failing, keep=self._keep_traffic)
        self._keep_traffic = False
        events = [(c, "faulty", fault) for c, fault in scenario.faulty()] if rnd == 1 else []
        events += [(int(c), "join", "") for c in scenario.joins(rnd)]
        events += [(int(c), "leave", "") for c in scenario.leaves(rnd)]
        for event in scenario.drifts(rnd):
            events.append((event.client, "drift", f"{event.kind}: {self._drift(event)}"))
        return events + found

    def _end_round(self, rnd: int) -> list[tuple[int, str, str]]:
        """The backend's events that happened during round ``rnd``, after its start
        (Flower: clients whose node came back and served the round's later requests)."""
        end = getattr(self.backend, "end_round", None)
        return [] if end is None else end(rnd)

    def _drift(self, event: DriftEvent) -> str:
        """Apply a drift event to the job's data; its description. A backend whose data
        is elsewhere (Flower: on the nodes) applies it there (its ``drift``)."""
        drift = getattr(self.backend, "drift", None)
        federation = self.backend.federation
        if drift is not None:
            done = drift(event)
        else:
            assert isinstance(federation, Federation)  # a backend without drift holds the data
            done = apply_drift(federation, event, self.pool)
        moved = moved_group(federation.groups, event)
        return done if moved is None else f"{done}; {moved}"


def resume(
    out: str | Path,
    progress: bool = True,
    experiment_factory: Callable[[ExperimentConfig], Experiment] | None = None,
    callbacks: Sequence[Callback] = (),
    model: nn.Module | None = None,
    federation: Federation | None = None,
    trust: bool = False,
    loss: LossFn | None = None,
    execution: Mapping[str, Any] | None = None,
) -> list[JobResult]:
    """Continue a killed run from its checkpoints, with its own resolved config.

    ``execution`` sets how the resumed jobs run (``jobs``, ``backend``, ``workers``,
    ``address``: :data:`~fedcluster.config.schema.EXECUTION_FIELDS`, which config.yaml leaves out).

    The config must be the one the checkpoints were written with; code it
    imports is imported only then or with ``trust``
    (:func:`~fedcluster.experiment.rundir.check_resumable`). A run started with a model or
    federation object (``model.given``, ``data.given`` in its config) or a loss
    function that cannot be imported (``train.loss: given:...``) needs the same
    objects again as ``model``, ``federation`` and ``loss`` (the objects' hashes are
    checked); without them it stops with one line before touching the run
    directory (:mod:`fedcluster.experiment.rebuild`).
    """
    path = Path(out)
    config = with_execution(
        checked_config(path, trust, model, federation, loss), **(execution or {})
    )
    if experiment_factory is not None:
        experiment = experiment_factory(config)
    else:
        experiment = Experiment(config, model=model, federation=federation, loss=loss)
    experiment.callbacks += list(callbacks)
    try:
        return experiment.run(path, resume=True, progress=progress)
    except ModelContractError as exc:  # the rebuilt model no longer runs on the rebuilt data
        raise FedclusterError(
            f"cannot resume {path}: {exc} -- do the model and data rebuilt from "
            f"config.yaml (model.name, data) still match the run's checkpoints?"
        ) from exc
    except FedclusterError:
        raise
    except (RuntimeError, ValueError) as exc:  # a tensor shape: the rebuilt objects differ
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FedclusterError(
            f"cannot resume {path}: {first} -- do the model and data rebuilt from "
            f"config.yaml (model.name, data) still match the run's checkpoints?"
        ) from exc


def checked_config(
    path: Path,
    trust: bool,
    model: nn.Module | None = None,
    federation: Federation | None = None,
    loss: LossFn | None = None,
) -> ExperimentConfig:
    """A run directory's config, once its checkpoints vouch for it and the objects it was
    started with from Python are passed (:func:`~fedcluster.experiment.rundir.check_resumable`,
    :func:`~fedcluster.experiment.rebuild.check_rebuildable`): what may be imported and built."""
    config = validate_config(load_yaml(path / "config.yaml"))
    check_resumable(RunDirectory(path), config, trust)
    check_rebuildable(path, config, model, federation, loss)
    return config


class JobTask:
    """One job, run in a worker process (picklable: the pool sends it there)."""

    def __init__(
        self,
        config: ExperimentConfig,
        model: nn.Module | None,
        federation: Federation | None,
        loss: LossFn | None,
        callbacks: list[Callback],
        path: Path,
        resume: bool,
        last: int,
        device: torch.device,
        threads: tuple[int, int],
    ) -> None:
        self.config = config.model_copy(update={"jobs": 1})
        self.model, self.federation, self.loss = model, federation, loss
        self.callbacks = callbacks
        self.path, self.resume, self.last = path, resume, last
        self.device, self.threads = device, threads

    def __call__(self, seed: int, index: int) -> JobResult:
        share, driver = self.threads
        torch.set_num_threads(share)
        experiment = Experiment(self.config, self.model, self.federation, loss=self.loss)
        # the driver's simulator threads: the MLP kernel's client groups (and so every
        # client's rounding) are the sequential run's
        experiment.backend_factory = SimulatorFactory(experiment.config, self.loss, driver)
        cfg = experiment.config
        rundir = RunDirectory(self.path)
        callbacks = [
            *run_directory_callbacks(rundir, cfg, self.last, progress=False),
            *self.callbacks,
        ]
        run = RunInfo(rundir.path, cfg, self.resume)
        setting, dynamics = experiment.seed_setting(seed, self.device)
        job = Job(experiment, run, cfg.algorithms[index], seed, setting, dynamics)
        return job.run(rundir, self.resume, self.last, callbacks)
