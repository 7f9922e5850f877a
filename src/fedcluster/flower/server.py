"""The ServerApp: fedcluster's runner driving Flower nodes.

:func:`flower_experiment` is the runner's :class:`~fedcluster.experiment.runner.Experiment`
with one change, given as its backend factory (:class:`FlowerBackends`): its
backend is a :class:`~fedcluster.flower.flower_backend.FlowerBackend` on the
ServerApp's grid, and it learns each seed's federation from the nodes
(``query.setup``). Everything else -- the algorithms, metrics, run directory,
checkpoints -- is the simulator's, so a run through Flower writes the same
``metrics.csv`` as the simulator (timing columns aside; tested).

- :func:`run_simulation` runs an experiment on Flower's simulation engine, one
  SuperNode per client (``fedcluster run --backend flower``);
- ``server_app`` is the ServerApp for a deployment with ``flwr run``; it reads
  the run config keys ``config`` (a YAML path), ``preset``, ``out``,
  ``round-timeout`` and ``min-replies`` (:mod:`fedcluster.flower.app`).

Data drift (``scenario.drift``) is applied by each node to its own clients'
data: the runner records each event with the backend at the start of its
round, and every message carries its clients' events of the job so far
(:meth:`FlowerBackend.drift`, :class:`~fedcluster.data.drift.DriftReplay`).
Not supported (a clear error, before any message is sent): the
``redistribute`` drift, which draws from the whole dataset.
"""

from __future__ import annotations

import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from torch import nn

from fedcluster.config.schema import ExperimentConfig, dump_config
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.experiment.callbacks import Callback, JobInfo
from fedcluster.experiment.runner import Experiment, JobResult
from fedcluster.flower import messages
from fedcluster.flower.app import STATUS
from fedcluster.flower.client import client_app
from fedcluster.flower.collect import TooFewReplies, required
from fedcluster.flower.flower_backend import (
    FIRST_TIMEOUT_FLOORS,
    FederationInfo,
    Fleet,
    FlowerBackend,
    describe_missing,
    discover,
)
from fedcluster.flower.nodedata import NodeManifest
from fedcluster.protocol.backend import FederationView


def check_supported(config: ExperimentConfig) -> None:
    """Raise :class:`ConfigError` for what the Flower backend cannot run."""
    for i, drift in enumerate(config.scenario.drift):
        if drift.kind == "redistribute":
            raise ConfigError(
                f"scenario.drift.{i}.kind: 'redistribute' redraws a client's samples from "
                "the whole dataset, which no node holds; it is not available on the Flower "
                "backend (rotate and swap_labels are)"
            )
    if config.model.buffers == "local":
        raise ConfigError(
            "model.buffers: 'local' (FedBN) keeps state on each client between rounds, "
            "which a Flower node does not keep; it runs on the simulator backend"
        )


class FlowerBackends:
    """The Flower backend factory of :class:`~fedcluster.experiment.runner.Experiment`: each seed's
    federation as the nodes report it (``query.setup``), and a backend sending the
    client computations to those nodes. ``expected`` is the server's manifest of the
    exported data (:func:`~fedcluster.flower.flower_backend.discover`)."""

    name = "flower"

    def __init__(
        self,
        config: ExperimentConfig,
        grid: Grid,
        timeout: float | None = None,
        expected: NodeManifest | None = None,
    ):
        check_supported(config)
        self.grid = grid
        self.deployment = config.deployment
        if timeout is not None:
            self.deployment = self.deployment.model_copy(update={"round_timeout": timeout})
        self.expected = expected
        self._text = dump_config(config)
        self._fleets: dict[int, Fleet] = {}
        self.current: FlowerBackend | None = None
        """The backend of the job running now (its round's ``replies/asked``)."""

    def federation(self, seed: int) -> FederationInfo:
        timeout = self.deployment.round_timeout
        if timeout is None:
            d = self.deployment
            timeout = min(d.timeout_ceiling, FIRST_TIMEOUT_FLOORS * d.timeout_floor)
        info, nodes = discover(self.grid, self._text, seed, timeout, self.expected)
        self._fleets[seed] = Fleet(
            nodes,
            dict(info.unavailable),
            answered=set(nodes.values()) | set(info.refused),
            seen={c for c in nodes if c not in info.unavailable},
            refused=dict(info.refused),
        )
        n = info.n_clients
        missing = self._fleets[seed].missing(n)
        need = required(n, self.deployment.min_replies)
        if n - len(missing) < need:
            raise TooFewReplies(
                f"{messages.SETUP}: {n - len(missing)} of the federation's {n} clients are "
                f"within reach, {need} needed (deployment.min_replies="
                f"{self.deployment.min_replies:g}); missing: {describe_missing(missing)}"
            )
        return info

    def backend(self, model: nn.Module, federation: FederationView, seed: int) -> FlowerBackend:
        assert isinstance(federation, FederationInfo)
        self.current = FlowerBackend(
            self.grid,
            model,
            federation,
            self._fleets[seed],
            self._text,
            seed,
            self.deployment,
            self.expected,
        )
        return self.current


def flower_experiment(
    config: ExperimentConfig,
    grid: Grid,
    timeout: float | None = None,
    expected: NodeManifest | None = None,
    callbacks: list[Callback] | None = None,
) -> Experiment:
    """The runner's experiment with its client computations on Flower nodes."""
    factory = FlowerBackends(config, grid, timeout, expected)
    return Experiment(config, backend_factory=factory, callbacks=callbacks or [])


def make_server_app(
    config: ExperimentConfig,
    out: str | Path,
    results: list[JobResult] | None = None,
    progress: bool = True,
) -> ServerApp:
    """A ServerApp that runs ``config`` and writes the run directory ``out``
    (the job results are appended to ``results`` when given)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        done = flower_experiment(config, grid).run(out, progress=progress)
        if results is not None:
            results.extend(done)

    return app


def run_simulation(
    config: ExperimentConfig, out: str | Path, num_cpus: float = 1.0, progress: bool = True
) -> list[JobResult]:
    """Run ``config`` on Flower's simulation engine: one SuperNode per client,
    ``num_cpus`` CPUs per ClientApp process, the run directory written to ``out``."""
    from flwr.simulation import run_simulation as flower_run

    check_supported(config)
    n_clients = Experiment(config).federation(config.seeds[0]).n_clients
    results: list[JobResult] = []
    flower_run(
        server_app=make_server_app(config, out, results, progress),
        client_app=client_app,
        num_supernodes=n_clients,
        backend_config={
            "client_resources": {"num_cpus": num_cpus, "num_gpus": 0.0},
            "init_args": {"include_dashboard": False},
        },
    )
    if len(results) != len(config.seeds) * len(config.algorithms):
        raise RuntimeError(
            f"the Flower run ended after {len(results)} of "
            f"{len(config.seeds) * len(config.algorithms)} jobs; see Flower's log above"
        )
    return results


class RoundLine(Callback):
    """One line per round on the ServerApp's output, which ``flwr run --stream`` shows:
    ``fedcluster: ifca seed 0 round 2/3: accuracy 0.8123, clusters 4, replies 18/24``."""

    def __init__(self, factory: FlowerBackends, rounds: int, emit=print) -> None:
        self.factory, self.rounds, self.emit = factory, rounds, emit

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        backend = self.factory.current
        asked = replied = 0
        if backend is not None:
            asked, replied = len(backend.asked), len(backend.replied & backend.asked)
        clusters = row.get("n_clusters")
        self.emit(
            f"fedcluster: {job.label} seed {job.seed} round {rnd}/{self.rounds}: "
            f"accuracy {_number(row.get('accuracy'))}, clusters {_number(clusters, 'd')}, "
            f"replies {replied}/{asked}",
            flush=True,
        )


def _number(value: Any, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(int(value) if spec == "d" else float(value), spec)


def write_status(out: str | Path, status: str, reason: str = "") -> Path:
    """Write the run directory's final status (:data:`~fedcluster.flower.app.STATUS`)."""
    path = Path(out) / STATUS
    path.parent.mkdir(parents=True, exist_ok=True)
    text = {
        "status": status,
        "reason": reason,
        "finished": f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}",
    }
    path.write_text(json.dumps(text, indent=1) + "\n")
    return path


def run_deployed(
    config: ExperimentConfig, out: str, grid: Grid, expected: NodeManifest | None
) -> None:
    """Run ``config`` on the grid's nodes, one line per round on stdout; the run
    directory's status (:data:`~fedcluster.flower.app.STATUS`) records the outcome.
    A fedcluster error (too few replies, bad data, a bad config) is one line,
    logged and re-raised without its traceback so that Flower marks the run failed."""
    factory = FlowerBackends(config, grid, expected=expected)
    experiment = Experiment(
        config, backend_factory=factory, callbacks=[RoundLine(factory, config.rounds)]
    )
    try:
        experiment.run(out, progress=False)
    except FedclusterError as exc:
        _fail(out, exc)
    except BaseException as exc:
        write_status(out, "failed", " ".join(f"{type(exc).__name__}: {exc}".split()))
        raise
    write_status(out, "completed")


class RunFailed(FedclusterError):
    """The deployed run stopped (its reason is in the run directory's status)."""


def _fail(out: str, exc: FedclusterError) -> NoReturn:
    """End the ServerApp with one line: logged, in the run directory's status (when
    ``out`` is known), and raised without a traceback so that Flower marks the run
    failed (``flwr ls``)."""
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    if out:
        write_status(out, "failed", reason)
    print(f"fedcluster: the run failed: {reason}", file=sys.stderr, flush=True)
    sys.tracebacklimit = 0  # the process ends with this exception: its line, no traceback
    raise RunFailed(reason) from None


server_app = ServerApp()


@server_app.main()
def _deployed(grid: Grid, context: Context) -> None:
    """``flwr run`` entry point: the run config names the experiment and the output."""
    from fedcluster.flower.app import config_from_run

    try:
        config, out, expected = config_from_run(context.run_config)
    except FedclusterError as exc:
        _fail(str(context.run_config.get("out") or ""), exc)
    run_deployed(config, out, grid, expected)
