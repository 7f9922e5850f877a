"""The ServerApp: fedcluster's runner driving Flower nodes (DESIGN principle 1).

:func:`flower_experiment` is the runner's :class:`~fedcluster.runner.Experiment`
with one change, given as its backend factory (:class:`FlowerBackends`): its
backend is a :class:`~fedcluster.flower.backend.FlowerBackend` on the
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

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from torch import nn

from fedcluster.config import ExperimentConfig, dump_config
from fedcluster.engine.backend import FederationView
from fedcluster.errors import ConfigError
from fedcluster.flower.backend import FederationInfo, FlowerBackend, discover
from fedcluster.flower.client import client_app
from fedcluster.runner import Experiment, JobResult


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
    """The Flower backend factory of :class:`~fedcluster.runner.Experiment`: each seed's
    federation as the nodes report it (``query.setup``), and a backend sending the
    client computations to those nodes."""

    def __init__(self, config: ExperimentConfig, grid: Grid, timeout: float | None = None):
        check_supported(config)
        self.grid = grid
        self.timeout = timeout if timeout is not None else config.deployment.round_timeout
        self.min_replies = config.deployment.min_replies
        self._text = dump_config(config)
        self._nodes: dict[int, dict[int, int]] = {}
        self._offline: dict[int, dict[int, str]] = {}

    def federation(self, seed: int) -> FederationInfo:
        info, self._nodes[seed] = discover(self.grid, self._text, seed, self.timeout)
        self._offline[seed] = {}  # nodes lost during the seed's jobs
        return info

    def backend(self, model: nn.Module, federation: FederationView, seed: int) -> FlowerBackend:
        assert isinstance(federation, FederationInfo)
        return FlowerBackend(
            self.grid,
            model,
            federation,
            self._nodes[seed],
            self._text,
            seed,
            self.timeout,
            self.min_replies,
            self._offline[seed],
        )


def flower_experiment(
    config: ExperimentConfig, grid: Grid, timeout: float | None = None
) -> Experiment:
    """The runner's experiment with its client computations on Flower nodes."""
    return Experiment(config, backend_factory=FlowerBackends(config, grid, timeout))


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


server_app = ServerApp()


@server_app.main()
def _deployed(grid: Grid, context: Context) -> None:
    """``flwr run`` entry point: the run config names the experiment and the output."""
    from fedcluster.flower.app import config_from_run

    config, out = config_from_run(context.run_config)
    timeout = config.deployment.round_timeout
    flower_experiment(config, grid, timeout=timeout).run(out, progress=False)
