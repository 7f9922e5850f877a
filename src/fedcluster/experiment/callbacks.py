"""Callbacks of the round loop: what happens around each run, job and round.

The runner (:mod:`fedcluster.experiment.runner`) calls every callback of a run at five
points; the run directory's CSV writers, checkpoints, the progress bar and
the summary are callbacks themselves, and a user attaches their own from
Python (a logger, early stopping) without editing the runner
(``Experiment(config, callbacks=[...])``). Modelled on pfl-research's
callbacks (``pfl.callback``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from fedcluster.config.schema import ExperimentConfig
    from fedcluster.experiment.rundir import Checkpoint, JobResult
    from fedcluster.privacy.central import CentralDP
    from fedcluster.privacy.ledger import LocalDP


@dataclass(frozen=True)
class RunInfo:
    """One run: its directory and resolved config; ``resume`` when continuing a killed run;
    ``record`` the code and data that make it (:mod:`fedcluster.experiment.provenance`), its data
    entries filled in as each seed's federation is built."""

    path: Path
    config: ExperimentConfig
    resume: bool = False
    record: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobInfo:
    """One (algorithm, seed) job of a run, as the runner keeps it between rounds.

    ``label`` is ``metrics.csv``'s ``algorithm``. During :meth:`Callback.on_round_end`
    the round's other records are here too: ``events`` (``(client, kind,
    detail)``: joins, departures, drift, failures, rejections), ``clusters``
    (each client's cluster, −1 unassigned; ``None`` for unclustered methods),
    ``groups`` (ground truth, where known), ``diagnostics`` (the
    algorithm's per-round scalars) and ``client_results`` (one
    :func:`~fedcluster.experiment.client_results.client_records` dict per evaluated client,
    the rows of ``clients.csv``; empty in a round without evaluation). ``rows``
    holds every metrics row so far (of a resumed job too); ``privacy`` the job's
    DP ledger (local or central).
    """

    run: RunInfo
    label: str
    seed: int
    first_round: int = 1
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[int, str, str]] = field(default_factory=list)
    clusters: np.ndarray | None = None
    groups: np.ndarray | None = None
    diagnostics: dict[str, float] = field(default_factory=dict)
    client_results: list[dict[str, Any]] = field(default_factory=list)
    privacy: LocalDP | CentralDP | None = None
    wall_offset: float = 0.0
    """Seconds the job had run before this process took it up (a resumed job)."""
    restored: Checkpoint | None = None
    """The checkpoint a resumed job continues from (None: it starts at round 1)."""


class Callback:
    """Override what you need; every method does nothing by default.

    ``row`` is the round's ``metrics.csv`` row as a dict (column -> value,
    NaN where empty); ``state`` is the algorithm's server state (read it, do
    not change it). A callback whose :meth:`on_round_end` returns ``True``
    stops the job after that round (early stopping).
    """

    def on_run_start(self, run: RunInfo) -> None:
        """Before the first job."""

    def on_job_start(self, job: JobInfo) -> None:
        """Before a job's first round (``job.first_round`` > 1 when resumed)."""

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> bool | None:
        """After round ``rnd`` was evaluated; return ``True`` to stop the job here."""

    def on_job_end(self, job: JobInfo, result: JobResult) -> None:
        """After a job's last round."""

    def on_run_end(self, run: RunInfo, results: list[JobResult]) -> None:
        """After the last job."""
