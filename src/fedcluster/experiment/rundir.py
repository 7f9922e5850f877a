"""The run directory and the round loop's built-in callbacks that write it.

Run directory (DESIGN "Run directory"): ``config.yaml`` (fully resolved),
``metrics.csv`` (one row per round x algorithm x seed), ``clusters.csv``
(client -> cluster per round, with the true group; −1 for a client not
present), ``events.csv`` (per job and round: faulty clients, joins,
departures, drift, failures and rejections, each with client and detail),
``diagnostics.csv`` (an algorithm's per-round scalars), ``clients.csv`` (each
client's test accuracy, loss and samples at the evaluation rounds, with its
group and cluster), ``select_k.csv`` (the
criterion per K of ``n_clusters: auto`` jobs), ``summary.json`` / ``summary.md``
and ``checkpoints/``. Each file is written by one callback
(:mod:`fedcluster.experiment.callbacks`), so the runner's loop does none of it.
Checkpoints are written atomically every ``checkpoint_every`` rounds.
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tqdm.auto import tqdm

from fedcluster.config.plugins import is_import_path
from fedcluster.config.schema import ExperimentConfig, dump_config
from fedcluster.errors import FedclusterError
from fedcluster.experiment import safefiles, tensor_digest
from fedcluster.experiment.callbacks import Callback, JobInfo, RunInfo
from fedcluster.experiment.client_results import CLIENT_COLUMNS, client_line
from fedcluster.experiment.metrics import COLUMNS, format_row, note_cluster_shortfall
from fedcluster.experiment.provenance import config_text
from fedcluster.experiment.summary import format_table, summary_rows

CLUSTER_COLUMNS = ["algorithm", "seed", "round", "client", "cluster", "true_group"]
EVENT_COLUMNS = ["algorithm", "seed", "round", "client", "kind", "detail"]
DIAGNOSTIC_COLUMNS = ["algorithm", "seed", "round", "name", "value"]
SELECT_K_COLUMNS = ["algorithm", "seed", "parameter", "criterion", "k", "value", "chosen"]


@dataclass
class JobResult:
    """The per-round metric rows of one (algorithm, seed) job."""

    algorithm: str
    seed: int
    rows: list[dict[str, object]]
    wall_seconds: float


PREPARED = (".lock", "deployment")
"""What a new run's directory may hold already: its lock, and the ``deployment/`` folder
``fedcluster flower local`` writes before its ServerApp starts the run."""


def _free(path: Path) -> bool:
    """Whether a new run may claim ``path``: absent, or a directory holding only
    :data:`PREPARED` entries."""
    if not os.path.lexists(path):
        return True
    return path.is_dir() and all(p.name in PREPARED for p in path.iterdir())


def fresh_run_path(out: str | Path, overwrite: bool = False) -> Path:
    """Where a new run asked to write ``out`` writes.

    ``out`` itself when it is free (absent or empty); with ``overwrite`` an existing
    run directory there is emptied first (while holding its lock: never one that a
    run or resume is writing), and anything that is not a run directory refused;
    otherwise the first free ``out-2``, ``out-3``, ... (re-running a notebook cell
    keeps the earlier run).
    """
    path = Path(out)
    if _free(path):
        return path
    if not path.is_dir():
        raise FedclusterError(f"--out {path} is an existing file or under one, not a directory")
    if overwrite:
        if not (path / "config.yaml").is_file():
            raise FedclusterError(
                f"--overwrite: {path} is not a run directory (no config.yaml); "
                "it replaces run directories only"
            )
        with RunDirectory(path).lock():
            for entry in path.iterdir():
                if entry.name in PREPARED:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        return path
    n = 2
    while not _free(path.with_name(f"{path.name}-{n}")):
        n += 1
    return path.with_name(f"{path.name}-{n}")


class RunDirectory:
    """Reads and writes the files of a run directory, atomically where it matters."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metrics = self.path / "metrics.csv"
        self.clusters = self.path / "clusters.csv"
        self.clients = self.path / "clients.csv"
        self.diagnostics = self.path / "diagnostics.csv"
        self.events = self.path / "events.csv"
        self.checkpoints = self.path / "checkpoints"
        self.artifacts = self.path / "artifacts"
        self.select_k = self.path / "select_k.csv"

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the run directory for one writer (``.lock``, an advisory ``flock``).

        A second run or resume of the same directory gets a one-line error
        naming the holder's pid. The lock dies with its process, so the lock
        file a killed run leaves behind is simply taken over; a symlink at
        ``.lock`` is refused (:mod:`fedcluster.experiment.safefiles`).
        """
        if not self.path.is_dir():
            raise FedclusterError(f"{self.path} is not a run directory")
        fd = safefiles.open_fd(self.path / ".lock", os.O_RDWR | os.O_CREAT)
        with os.fdopen(fd, "r+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = f.read().strip() or "unknown"
                raise FedclusterError(
                    f"run directory {self.path} is in use by process {holder} "
                    "(a run or resume of it); wait for it to end or choose another --out"
                ) from None
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextmanager
    def claim(self) -> Iterator[None]:
        """Hold a new run's directory: created here (``mkdir``, exclusive) or empty
        (but for :data:`PREPARED`).

        The lock is taken before the directory is looked at, so of two runs
        started with the same ``--out`` one gets the directory and the other a
        one-line error, whatever the interleaving. When the body fails before any
        checkpoint, the directory is removed -- only if this process created it,
        and while it still holds the lock -- so the same command can run again.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.mkdir()
            created = True
        except FileExistsError:
            if not self.path.is_dir():
                raise FedclusterError(
                    f"--out {self.path} is an existing file or under one, not a directory"
                ) from None
            created = False
        except OSError as exc:  # read-only, /proc, no permission
            raise FedclusterError(
                f"--out {self.path}: cannot create the run directory ({exc.strerror})"
            ) from None
        with self.lock():
            if not created and any(p.name not in PREPARED for p in self.path.iterdir()):
                raise FedclusterError(
                    f"run directory {self.path} is not empty; choose another --out"
                )
            try:
                yield
            except BaseException:
                if created and not any(self.checkpoints.glob("*.pt")):
                    shutil.rmtree(self.path, ignore_errors=True)
                raise

    def create(self, config: ExperimentConfig, record: dict[str, Any]) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self.write_config(config, record)
        for path, header in self.tables():
            safefiles.write_atomic(path, _csv_text([header]))

    def write_config(self, config: ExperimentConfig, record: dict[str, Any]) -> None:
        """``config.yaml``: the resolved config and the run's record
        (:mod:`fedcluster.experiment.provenance`)."""
        safefiles.write_atomic(self.path / "config.yaml", config_text(config, record))

    def checkpoint_path(self, label: str, seed: int) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_.=," else "_" for ch in label)
        return self.checkpoints / f"{safe}-seed{seed}.pt"

    @contextmanager
    def tables_locked(self) -> Iterator[None]:
        """Hold the tables for one read-modify-write or append: the jobs of a parallel
        run (:mod:`fedcluster.experiment.jobs`) write them from several processes. An advisory
        ``flock`` on the directory itself, so the directory holds no extra file."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def append(self, path: Path, rows: list[list[str]]) -> None:
        with self.tables_locked():
            safefiles.append(path, _csv_text(rows))

    def _rewrite(
        self,
        path: Path,
        keep: Callable[[dict[str, str]], bool],
        order: Callable[[dict[str, str]], tuple] | None = None,
    ) -> None:
        reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
        header = list(reader.fieldnames or [])
        rows = [r for r in reader if keep(r)]
        if order is not None:
            rows.sort(key=order)
        safefiles.write_atomic(path, _csv_text([header, *([r[k] for k in header] for r in rows)]))

    def tables(self) -> list[tuple[Path, list[str]]]:
        return [
            (self.metrics, COLUMNS),
            (self.clusters, CLUSTER_COLUMNS),
            (self.diagnostics, DIAGNOSTIC_COLUMNS),
            (self.events, EVENT_COLUMNS),
            (self.clients, CLIENT_COLUMNS),
        ]

    def rebuild_job(
        self, label: str, seed: int, lines: dict[Path, list[list[str]]], through: int
    ) -> list[str]:
        """Replace one job's rows in every table by ``lines``, what its checkpoint of
        round ``through`` holds (0: no checkpoint).

        The checkpoint is the source of truth: rows of the job's rounds up to
        ``through`` that were edited, cut or deleted come back as they were
        written, rows beyond it go (the resumed job writes them again), and a
        deleted table is recreated. ``clients.csv``, which checkpoints do not
        hold, keeps the job's rows up to ``through``. Other jobs' rows are kept;
        rows that cannot be read are dropped. Returns the names of the tables
        whose rows of this job up to ``through`` differed from the checkpoint's
        (or that held unreadable rows, or were missing): on a normal resume, none.
        """
        changed = []
        with self.tables_locked():
            for path, header in self.tables():
                kept, mine, dropped = self._rows_apart(path, header, label, seed)
                r = header.index("round")
                mine = [row for row in mine if int(row[r]) <= through]
                if path == self.clients:
                    new = mine
                else:
                    new = lines.get(path, [])
                    if mine != new or dropped or not path.exists():
                        changed.append(path.name)
                safefiles.write_atomic(path, _csv_text([header, *kept, *new]))
        return changed

    @staticmethod
    def _rows_apart(
        path: Path, header: list[str], label: str, seed: int
    ) -> tuple[list[list[str]], list[list[str]], int]:
        """Other jobs' rows, this job's rows, and the number of unreadable rows of a table."""
        if not os.path.lexists(path):
            return [], [], 0
        rows = list(csv.reader(io.StringIO(_read_text(path), newline="")))
        kept, mine, dropped = [], [], 0
        a, s, r = header.index("algorithm"), header.index("seed"), header.index("round")
        for row in rows[1:] if rows and rows[0] == header else rows:
            if len(row) != len(header) or not (row[s].isdigit() and row[r].isdigit()):
                dropped += 1
            elif row[a] == label and int(row[s]) == seed:
                mine.append(row)
            else:
                kept.append(row)
        return kept, mine, dropped

    def sort_rows(self, jobs: list[tuple[str, int]]) -> None:
        """Put rows in job order, then round (resumed jobs, and jobs run in parallel, append
        after later jobs' rows); ``select_k.csv`` in job order, then K."""
        rank = {(label, seed): i for i, (label, seed) in enumerate(jobs)}

        def order(r: dict[str, str]) -> tuple:
            return (rank.get((r["algorithm"], int(r["seed"])), len(rank)), int(r["round"]))

        def k_order(r: dict[str, str]) -> tuple:
            return (rank.get((r["algorithm"], int(r["seed"])), len(rank)), int(r["k"]))

        with self.tables_locked():
            for path, _ in self.tables():
                self._rewrite(path, lambda r: True, order)
            if self.select_k.exists():  # jobs in parallel choose their K in any order
                self._rewrite(self.select_k, lambda r: True, k_order)

    def save_k_curve(
        self, label: str, seed: int, parameter: str, curve: dict[int, float], chosen: int
    ) -> None:
        """A job's ``n_clusters: auto`` choice: one ``select_k.csv`` row per K of the range
        (the silhouette, ``chosen`` 1 on the chosen K), replacing the job's earlier rows."""
        mine = [
            [label, str(seed), parameter, "silhouette", str(k), repr(v), str(int(k == chosen))]
            for k, v in sorted(curve.items())
        ]
        with self.tables_locked():
            kept = []
            if self.select_k.exists():
                rows = _read_rows(self.select_k)
                kept = [r for r in rows if (r[0], r[1]) != (label, str(seed))]
            safefiles.write_atomic(self.select_k, _csv_text([SELECT_K_COLUMNS, *kept, *mine]))

    def chosen_k(self, label: str, seed: int) -> int | None:
        """The K ``select_k.csv`` records as chosen for the job (``None``: no such row)."""
        if not self.select_k.exists():
            return None
        rows = _read_rows(self.select_k)
        chosen = [r[4] for r in rows if (r[0], r[1], r[6]) == (label, str(seed), "1")]
        return int(chosen[0]) if len(chosen) == 1 and chosen[0].isdigit() else None

    def save_artifacts(self, label: str, seed: int, arrays: dict[str, np.ndarray]) -> None:
        """Arrays an algorithm keeps at the end of a job, as ``artifacts/<label>-seed<s>.npz``."""
        if not arrays:
            return
        self.artifacts.mkdir(exist_ok=True)
        path = self.artifacts / self.checkpoint_path(label, seed).with_suffix(".npz").name
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub: **kwds as allow_pickle
        safefiles.write_atomic(path, buffer.getvalue())


def _csv_text(rows: list[list[str]]) -> str:
    buffer = io.StringIO(newline="")
    csv.writer(buffer).writerows(rows)
    return buffer.getvalue()


def _read_rows(path: Path) -> list[list[str]]:
    """A table's rows below its header; rows of the wrong width are dropped."""
    rows = list(csv.reader(io.StringIO(_read_text(path), newline="")))
    return [r for r in rows[1:] if len(r) == len(rows[0])] if rows else []


def _read_text(path: Path) -> str:
    """A table's text; undecodable bytes become U+FFFD (such rows are dropped as unreadable)."""
    return safefiles.read_bytes(path).decode("utf-8", errors="replace")


CHECKPOINT_FORMAT = 4
"""Version of the checkpoint layout (1: pickled state, before it was made safe; 2: before
the config digest; 3: before the stored values' digests)."""


def config_digest(config: ExperimentConfig) -> str:
    """SHA-256 of the resolved config as ``config.yaml`` holds it: binds checkpoints to it."""
    return hashlib.sha256(dump_config(config).encode()).hexdigest()


def code_imports(config: ExperimentConfig) -> list[str]:
    """The ``package.module:attr`` paths a config makes fedcluster import (model, loss,
    algorithms, dataset, partition, federation factory)."""
    names = [
        config.model.name,
        config.train.loss,
        config.data.dataset,
        str(config.data.partition.get("name", "")),
        config.data.federation or "",
        *(a.name for a in config.algorithms),
    ]
    return [n for n in names if is_import_path(n)]


def check_resumable(rundir: RunDirectory, config: ExperimentConfig, trust: bool) -> None:
    """Before anything of a run's config is imported: every checkpoint was written with it,
    and code it imports (``model.name: 'pkg.mod:factory'``) is imported only when a
    checkpoint vouches that the run started with it, or with ``trust`` (``--trust``)."""
    digest = config_digest(config)
    vouched = False
    for path in sorted(rundir.checkpoints.glob("*.pt")):
        if load_checkpoint(path).config_sha256 != digest:
            raise FedclusterError(
                f"config.yaml of {rundir.path} is not the config checkpoint {path.name} was "
                "written with (was it edited?); restore it, or delete the checkpoint to "
                "restart that job from round 1"
            )
        vouched = True
    imports = code_imports(config)
    if imports and not vouched and not trust:
        raise FedclusterError(
            f"config.yaml of {rundir.path} imports {', '.join(imports)} and no checkpoint "
            "shows the run started with it; resume it with --trust if you trust that code"
        )


@dataclass
class Checkpoint:
    """What a job's checkpoint holds: the round it ends, the server state's record
    (:meth:`~fedcluster.algorithms.base.State.to_record`), the metrics rows so far,
    the wall time and the local-DP ledger."""

    round: int
    state: dict[str, Any]
    rows: list[dict[str, Any]]
    wall_seconds: float
    privacy: dict[str, Any] | None
    events: list[list[Any]] = field(default_factory=list)
    """``[round, client, kind, detail]`` of every round so far."""
    diagnostics: list[list[Any]] = field(default_factory=list)
    """``[round, name, value]`` of every round so far."""
    cluster_rounds: list[int] = field(default_factory=list)
    clusters: torch.Tensor | None = None
    """Every client's cluster in each of ``cluster_rounds`` [R, n] (None: unclustered)."""
    config_sha256: str = ""
    """:func:`config_digest` of the run's config when the checkpoint was written."""

    def check(self, path: Path, label: str, seed: int, config: ExperimentConfig) -> None:
        """Refuse a checkpoint whose metadata disagrees with the run's config or itself.

        The round must lie within the run and the rows be exactly this job's
        rounds 1..round, so that a forged or shifted row never reaches
        ``metrics.csv`` (the config digest is checked first, :func:`check_resumable`).
        """
        why = _inconsistency(self, label, seed, config.rounds)
        if why:
            raise FedclusterError(
                f"checkpoint {path}: {why}; delete it to restart that job from round 1"
            )

    def lines(
        self, rundir: RunDirectory, label: str, seed: int, groups: np.ndarray | None
    ) -> dict[Path, list[list[str]]]:
        """The job's rows of every table up to this checkpoint, as they were written."""
        clusters: list[list[str]] = []
        if self.clusters is not None:
            for rnd, assign in zip(self.cluster_rounds, self.clusters.numpy(), strict=True):
                clusters += cluster_lines(label, seed, rnd, assign, groups)
        return {
            rundir.metrics: [format_row(row) for row in self.rows],
            rundir.clusters: clusters,
            rundir.events: [
                line
                for rnd, c, kind, detail in self.events
                for line in event_lines(label, seed, rnd, [(c, kind, detail)])
            ],
            rundir.diagnostics: [
                line
                for rnd, name, value in self.diagnostics
                for line in diagnostic_lines(label, seed, rnd, {name: value})
            ],
        }


def _inconsistency(ckpt: Checkpoint, label: str, seed: int, rounds: int) -> str | None:
    """What is wrong with a checkpoint's metadata for job (label, seed) of a run, or None."""
    rnd = ckpt.round
    if type(rnd) is not int or not 1 <= rnd <= rounds:
        return f"round {rnd!r} is outside the run's rounds 1..{rounds}"
    rows = ckpt.rows
    expected = [(r, label, seed) for r in range(1, rnd + 1)]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return "its metrics rows are not a list of rows"
    if [(r.get("round"), r.get("algorithm"), r.get("seed")) for r in rows] != expected:
        return f"its metrics rows are not rounds 1..{rnd} of {label} seed {seed}"
    plain = (int, float, str, type(None))
    if any(not all(isinstance(v, plain) for v in r.values()) for r in rows):
        return "a metrics row holds a value that is not a number or text"
    if not isinstance(ckpt.wall_seconds, int | float) or not ckpt.wall_seconds >= 0:
        return f"wall_seconds {ckpt.wall_seconds!r} is not a time"
    for name, entries in (("events", ckpt.events), ("diagnostics", ckpt.diagnostics)):
        if not isinstance(entries, list) or not all(
            isinstance(e, list) and e and type(e[0]) is int and 1 <= e[0] <= rnd for e in entries
        ):
            return f"its {name} are not records of rounds 1..{rnd}"
    cluster_rounds = ckpt.cluster_rounds
    if not isinstance(cluster_rounds, list) or not all(
        type(r) is int and 1 <= r <= rnd for r in cluster_rounds
    ):
        return f"its cluster rounds are not within 1..{rnd}"
    clusters = ckpt.clusters
    if clusters is not None and (
        not isinstance(clusters, torch.Tensor)
        or clusters.ndim != 2
        or len(clusters) != len(cluster_rounds)
    ):
        return "its cluster assignments do not match its cluster rounds"
    return None


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write atomically: tensors through torch's format, everything else as JSON text."""
    meta = {
        "format": CHECKPOINT_FORMAT,
        "round": checkpoint.round,
        "rows": checkpoint.rows,
        "wall_seconds": checkpoint.wall_seconds,
        "privacy": checkpoint.privacy,
        "events": checkpoint.events,
        "diagnostics": checkpoint.diagnostics,
        "cluster_rounds": checkpoint.cluster_rounds,
        "config_sha256": checkpoint.config_sha256,
    }
    tensors = {"state": checkpoint.state, "clusters": checkpoint.clusters}
    meta["sha256"] = tensor_digest.digests(tensors)
    buffer = io.BytesIO()  # serialised first: a full disk is then an OSError of the write
    torch.save({"meta": json.dumps(meta), **tensors}, buffer)
    safefiles.write_atomic(path, buffer.getvalue())


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint without running any code from it (``weights_only=True``);
    a damaged, foreign or other-version file is a :class:`FedclusterError` naming it."""
    try:
        raw = torch.load(io.BytesIO(safefiles.read_bytes(path)), weights_only=True)
        meta = json.loads(raw["meta"])
    except Exception as exc:  # torch raises many kinds on a damaged or crafted file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FedclusterError(
            f"checkpoint {path} cannot be read safely ({reason[:200]}); "
            "delete it to restart that job from round 1"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise FedclusterError(
            f"checkpoint {path} has format {found}, this fedcluster reads "
            f"format {CHECKPOINT_FORMAT}; rerun the job or use the fedcluster that wrote it"
        )
    try:
        damage = tensor_digest.first_mismatch(
            {"state": raw["state"], "clusters": raw["clusters"]}, meta["sha256"]
        )
        if damage:
            raise FedclusterError(
                f"checkpoint {path}: {damage} (the file was altered or damaged); "
                "delete it to restart that job from round 1"
            )
        return Checkpoint(
            meta["round"],
            raw["state"],
            meta["rows"],
            meta["wall_seconds"],
            meta["privacy"],
            meta["events"],
            meta["diagnostics"],
            meta["cluster_rounds"],
            raw["clusters"],
            meta["config_sha256"],
        )
    except (KeyError, TypeError) as exc:
        raise FedclusterError(
            f"checkpoint {path} lacks {exc}; delete it to restart that job from round 1"
        ) from None


def cluster_lines(
    label: str, seed: int, rnd: int, assign: np.ndarray, groups: np.ndarray | None
) -> list[list[str]]:
    """``clusters.csv`` rows of one round: every client's cluster and true group."""
    return [
        [
            label,
            str(seed),
            str(rnd),
            str(c),
            str(int(assign[c])),
            "" if groups is None else str(int(groups[c])),
        ]
        for c in range(len(assign))
    ]


def event_lines(
    label: str, seed: int, rnd: int, events: list[tuple[int, str, str]]
) -> list[list[str]]:
    """``events.csv`` rows of one round."""
    return [[label, str(seed), str(rnd), str(c), kind, detail] for c, kind, detail in events]


def diagnostic_lines(label: str, seed: int, rnd: int, values: dict[str, float]) -> list[list[str]]:
    """``diagnostics.csv`` rows of one round."""
    return [[label, str(seed), str(rnd), k, repr(float(v))] for k, v in values.items()]


class MetricsWriter(Callback):
    """``metrics.csv``: the round's row."""

    def __init__(self, rundir: RunDirectory) -> None:
        self.rundir = rundir

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        self.rundir.append(self.rundir.metrics, [format_row(row)])


class EventsWriter(Callback):
    """``events.csv``: the round's joins, departures, drift, failures and rejections."""

    def __init__(self, rundir: RunDirectory) -> None:
        self.rundir = rundir

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        if job.events:
            self.rundir.append(
                self.rundir.events, event_lines(job.label, job.seed, rnd, job.events)
            )


class DiagnosticsWriter(Callback):
    """``diagnostics.csv``: the algorithm's per-round scalars."""

    def __init__(self, rundir: RunDirectory) -> None:
        self.rundir = rundir

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        if job.diagnostics:
            rows = diagnostic_lines(job.label, job.seed, rnd, job.diagnostics)
            self.rundir.append(self.rundir.diagnostics, rows)


class ClustersWriter(Callback):
    """``clusters.csv``: every client's cluster and true group."""

    def __init__(self, rundir: RunDirectory) -> None:
        self.rundir = rundir

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        if job.clusters is not None:
            rows = cluster_lines(job.label, job.seed, rnd, job.clusters, job.groups)
            self.rundir.append(self.rundir.clusters, rows)


class ClientsWriter(Callback):
    """``clients.csv``: every evaluated client's accuracy, loss and test samples, with its
    group and cluster (:mod:`fedcluster.experiment.client_results`)."""

    def __init__(self, rundir: RunDirectory) -> None:
        self.rundir = rundir

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        if job.client_results:
            lines = [client_line(record) for record in job.client_results]
            self.rundir.append(self.rundir.clients, lines)


class Checkpointer(Callback):
    """``checkpoints/<label>-seed<s>.pt`` every ``every`` rounds and after the last,
    written atomically: what :func:`fedcluster.experiment.runner.resume` continues from."""

    def __init__(self, rundir: RunDirectory, every: int, last: int, digest: str) -> None:
        self.rundir = rundir
        self.every = every
        self.last = last
        self.digest = digest
        self._started: dict[tuple[str, int], float] = {}
        self._history: dict[tuple[str, int], Checkpoint] = {}

    def on_job_start(self, job: JobInfo) -> None:
        key = (job.label, job.seed)
        self._started[key] = time.perf_counter() - job.wall_offset
        restored = job.restored
        self._history[key] = (
            Checkpoint(0, {}, [], 0.0, None)
            if restored is None
            else Checkpoint(
                0,
                {},
                [],
                0.0,
                None,
                list(restored.events),
                list(restored.diagnostics),
                list(restored.cluster_rounds),
                restored.clusters,
            )
        )

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        key = (job.label, job.seed)
        history = self._history[key]
        history.events += [[rnd, int(c), kind, detail] for c, kind, detail in job.events]
        history.diagnostics += [[rnd, k, float(v)] for k, v in job.diagnostics.items()]
        if job.clusters is not None:
            assign = torch.as_tensor(np.asarray(job.clusters, dtype=np.int64)).unsqueeze(0)
            history.cluster_rounds.append(rnd)
            history.clusters = (
                assign if history.clusters is None else torch.cat([history.clusters, assign])
            )
        if rnd % self.every and rnd != self.last:
            return
        checkpoint = replace(
            history,
            round=rnd,
            state=state.to_record(),
            rows=[_plain(row) for row in job.rows],
            wall_seconds=time.perf_counter() - self._started[key],
            privacy=None if job.privacy is None else job.privacy.state_dict(),
            config_sha256=self.digest,
        )
        save_checkpoint(self.rundir.checkpoint_path(job.label, job.seed), checkpoint)


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row with plain Python numbers (JSON)."""
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in row.items()}


class ProgressBar(Callback):
    """A progress bar per job, with the last accuracy (``tqdm.auto``: a widget in Jupyter,
    text in a terminal)."""

    def __init__(self, last: int) -> None:
        self.last = last
        self._bar: tqdm | None = None

    def on_job_start(self, job: JobInfo) -> None:
        self._bar = tqdm(
            total=self.last - job.first_round + 1,
            desc=f"{job.label} seed {job.seed}",
            leave=True,
            unit="round",
            dynamic_ncols=True,
        )

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        assert self._bar is not None
        if not math.isnan(row["accuracy"]):
            self._bar.set_postfix(acc=f"{row['accuracy']:.3f}", refresh=False)
        self._bar.update(1)

    def on_job_end(self, job: JobInfo, result: JobResult) -> None:
        assert self._bar is not None
        self._bar.close()


class SummaryWriter(Callback):
    """``summary.json`` and ``summary.md`` after the last job (rows in job order on resume)."""

    def __init__(self, rundir: RunDirectory) -> None:
        self.rundir = rundir

    def on_job_end(self, job: JobInfo, result: JobResult) -> None:
        note_cluster_shortfall(job.label, job.seed, result.rows)

    def on_run_end(self, run: RunInfo, results: list[JobResult]) -> None:
        if run.resume:
            self.rundir.sort_rows([(j.algorithm, j.seed) for j in results])
        write_summary(run.path, run.config, results, run.record)


def run_directory_callbacks(
    rundir: RunDirectory, config: ExperimentConfig, last: int, progress: bool
) -> list[Callback]:
    """The callbacks that write a run directory (and show progress)."""
    writers: list[Callback] = [
        MetricsWriter(rundir),
        EventsWriter(rundir),
        DiagnosticsWriter(rundir),
        ClustersWriter(rundir),
        ClientsWriter(rundir),
        Checkpointer(rundir, config.checkpoint_every, config.rounds, config_digest(config)),
        SummaryWriter(rundir),
    ]
    return [*writers, ProgressBar(last)] if progress else writers


def _finite(values: list[object]) -> list[float]:
    return [v for v in values if isinstance(v, float) and not math.isnan(v)]


def _reaches(value: object, level: float) -> bool:
    return isinstance(value, float) and value >= level


def _total(rows: list[dict[str, object]], column: str) -> int:
    """The sum of a counter column over a job's rows."""
    return int(sum(cast(float, r[column]) for r in rows))


def job_summary(job: JobResult) -> dict[str, object]:
    """Final and best accuracy, final purity, rounds to 0.9 purity, bytes and time of a job."""
    accs = _finite([r["accuracy"] for r in job.rows])
    last = job.rows[-1] if job.rows else {}
    purity_round = next(
        (r["round"] for r in job.rows if _reaches(r.get("purity"), 0.9)),
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
        "final_ari": None if _nan(last.get("ari")) else last.get("ari"),
        "final_nmi": None if _nan(last.get("nmi")) else last.get("nmi"),
        "final_n_clusters": None if _nan(last.get("n_clusters")) else last.get("n_clusters"),
        "n_groups": None if _nan(last.get("n_groups")) else last.get("n_groups"),
        "final_purity_ceiling": (
            None if _nan(last.get("purity_ceiling")) else last.get("purity_ceiling")
        ),
        "rounds_to_purity_0.9": purity_round,
        "bytes_up": _total(job.rows, "bytes_up"),
        "bytes_down": _total(job.rows, "bytes_down"),
        "wall_seconds": job.wall_seconds,
    }


def _nan(v: object) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def write_summary(
    path: Path, config: ExperimentConfig, results: list[JobResult], record: dict[str, Any]
) -> None:
    """``summary.json`` (per-job summaries, NaN as null, and the run's record) and
    ``summary.md`` (the table)."""
    jobs = [{k: None if _nan(v) else v for k, v in job_summary(j).items()} for j in results]
    summary = {"name": config.name, "record": record, "jobs": jobs}
    text = json.dumps(summary, indent=2, allow_nan=False)
    safefiles.write_atomic(path / "summary.json", text)
    safefiles.write_atomic(path / "summary.md", format_table(summary_rows(jobs)) + "\n")
