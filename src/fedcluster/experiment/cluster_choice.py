"""Test-time cluster choice: which cluster model of a finished run a device should use.

A device that joins after training holds data but, often, no labels. IFCA
(Ghosh et al. 2020, Alg. 1) places a client by the lowest loss of each cluster
model on its data, which needs labels. Without them, a model can be judged by
its own predictions; the rules, each computed for every cluster model ``k`` on
the device's samples ``x_1..x_N`` with ``p_k(x) = softmax(f_k(x))``:

- ``entropy`` (label-free): the lowest mean prediction entropy
  ``H_k = 1/N Σ_i −Σ_c p_k(x_i)_c log p_k(x_i)_c`` (nats). Entropy as a
  label-free measure of how well a model fits shifted test data is Tent's
  objective (Wang et al., "Tent: Fully Test-Time Adaptation by Entropy
  Minimization", ICLR 2021: the test entropy H(ŷ) = −Σ_c p(ŷ_c) log p(ŷ_c) of
  Sec. 3, chosen because "more confident predictions are all-in-all more
  correct" and entropy grows with shift, Sec. 1); here it selects a model
  instead of adapting one.
- ``confidence`` (label-free): the highest mean maximum softmax probability
  ``C_k = 1/N Σ_i max_c p_k(x_i)_c``, the baseline score of Hendrycks & Gimpel
  ("A Baseline for Detecting Misclassified and Out-of-Distribution Examples in
  Neural Networks", ICLR 2017): in-distribution samples get higher maximum
  probabilities than samples from another distribution.
- ``descriptor`` (label-free, FLUX runs only): the nearest cluster centroid of the
  label-free descriptor (latent mean and standard deviation) of the device's samples
  (Fenoglio et al., "FLUX", NeurIPS 2025, test-time assignment;
  :meth:`fedcluster.algorithms.flux.FLUX.descriptor_distances`); the score is the
  distance, a model that is no cluster's (the pre-trained one) scores infinity.
- ``loss`` (labelled, when the data has labels): the lowest mean loss with the
  run's loss function -- IFCA's cluster identity estimate, the choice the
  label-free rules are compared with.

The candidates are the models the run's clients use after its last round
(:meth:`~fedcluster.algorithms.base.Algorithm.eval_rows` at the final
checkpoint): a cluster model with no member is not offered. They are read
from the run directory as ``fedcluster resume`` reads them
(:func:`~fedcluster.experiment.runner.checked_config`,
:meth:`~fedcluster.experiment.runner.Job.checkpointed`),
which rebuilds the model from ``config.yaml`` (and its federation, for the
input shape and classes).

The device's data is a ``.npz`` file (read with ``allow_pickle=False``) holding
``x`` [N, *input shape] and optionally ``y`` [N] (integer labels) and ``group``
(an integer, the device's true group, kept for measurement), or a client file
of ``fedcluster flower export`` (its ``x_test``, ``y_test``). Anything else is
one :class:`~fedcluster.errors.DataError` naming the file and what is wrong.

With labels, each rule's choice also has an accuracy, and ``--record`` appends
one row per rule to the run's ``assign.csv`` (:data:`ASSIGN_COLUMNS`), which
``fedcluster report`` summarises per algorithm and group.
"""

from __future__ import annotations

import csv
import io
import math
import os
import stat
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedcluster.config.limits import check_path
from fedcluster.data.federation import Federation
from fedcluster.data.screen import bad_samples
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.model_eval import EVAL_ROWS
from fedcluster.engine.modes import LossFn, resolve_loss
from fedcluster.errors import DataError, FedclusterError
from fedcluster.experiment import safefiles
from fedcluster.experiment.callbacks import RunInfo
from fedcluster.experiment.rundir import RunDirectory
from fedcluster.experiment.summary import format_table

LABEL_FREE = ("entropy", "confidence", "descriptor")
"""The rules that need no labels."""
RULES = (*LABEL_FREE, "loss")
"""Every rule, the labelled one (``loss``) last."""
HIGHER_IS_BETTER = {"entropy": False, "confidence": True, "descriptor": False, "loss": False}
MAX_DATA_BYTES = 2**30
"""Largest data file, and largest array inside it once decompressed (1 GiB)."""
ASSIGN_FILE = "assign.csv"
ASSIGN_COLUMNS = [
    "algorithm",
    "seed",
    "data",
    "group",
    "samples",
    "rule",
    "model",
    "score",
    "accuracy",
    "labelled_model",
]
"""``assign.csv``: per (job, data file, rule) the model chosen, its score and, with
labels, its accuracy and the labelled choice's model."""


@dataclass
class DeviceData:
    """A device's samples ``x``, labels ``y`` (None: unlabelled) and true ``group``
    (None: unknown), named ``name`` in tables."""

    x: torch.Tensor
    y: torch.Tensor | None = None
    group: int | None = None
    name: str = "data"


@dataclass
class Assignment:
    """The rules' choices for one device among one job's cluster models.

    ``models`` are the candidates' indices in the job's evaluation rows,
    ``members`` how many of the run's clients use each; ``scores[rule]`` and
    ``accuracy`` (None without labels) are per candidate, ``chosen[rule]`` a
    model index.
    """

    algorithm: str
    seed: int
    data: str
    group: int | None
    samples: int
    models: list[int]
    members: list[int]
    scores: dict[str, list[float]]
    chosen: dict[str, int]
    accuracy: list[float] | None = None

    def chosen_accuracy(self, rule: str) -> float | None:
        """Accuracy on the device's data of the model ``rule`` chose (None: no labels)."""
        if self.accuracy is None:
            return None
        return self.accuracy[self.models.index(self.chosen[rule])]

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items()}
        out["chosen_accuracy"] = {r: self.chosen_accuracy(r) for r in self.chosen}
        return out

    def rows(self) -> list[list[str]]:
        """``assign.csv`` rows (:data:`ASSIGN_COLUMNS`), one per rule."""
        out = []
        for rule, model in self.chosen.items():
            score = self.scores[rule][self.models.index(model)]
            acc = self.chosen_accuracy(rule)
            out.append(
                [
                    self.algorithm,
                    str(self.seed),
                    self.data,
                    "" if self.group is None else str(self.group),
                    str(self.samples),
                    rule,
                    str(model),
                    repr(score),
                    "" if acc is None else repr(acc),
                    str(self.chosen["loss"]) if "loss" in self.chosen else "",
                ]
            )
        return out


def rule_scores(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Label-free scores of K models from their logits [K, N, C]: mean prediction
    entropy (nats) and mean maximum softmax probability, each [K]."""
    logp = F.log_softmax(logits.double(), dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(dim=-1)
    return {"entropy": entropy.mean(dim=1), "confidence": p.amax(dim=-1).mean(dim=1)}


def best(scores: Sequence[float], rule: str) -> int:
    """Position of the best score under ``rule`` (the first of equal ones)."""
    values = np.asarray(scores, dtype=np.float64)
    return int(np.argmax(values) if HIGHER_IS_BETTER[rule] else np.argmin(values))


@dataclass
class ClusterModels:
    """One finished job's cluster models, ready to score a device's data."""

    algorithm: str
    seed: int
    rows: torch.Tensor
    """The candidate models [M, d] (rows of the job's final evaluation models)."""
    models: list[int]
    members: list[int]
    layout: ParamLayout
    loss: LossFn
    input_shape: tuple[int, ...]
    n_classes: int
    float_inputs: bool
    descriptor_distances: Callable[[torch.Tensor], np.ndarray | None] | None = None
    """The job's distances of a device's samples to each cluster model [K] (FLUX)."""

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every candidate's logits on ``x``: [M, N, C] (the module in eval mode)."""
        module = self.layout.module
        device = next(module.parameters()).device
        was_training = module.training
        module.eval()
        try:
            step = max(1, EVAL_ROWS // max(1, len(self.models)))
            parts = []
            for s in range(0, len(x), step):
                part = x[s : s + step].to(device)
                parts.append(
                    torch.stack([self.layout.forward(r.to(device), part) for r in self.rows])
                )
            return torch.cat(parts, dim=1).float().cpu()
        finally:
            module.train(was_training)

    def assign(self, data: DeviceData) -> Assignment:
        """Score every candidate on ``data`` under each rule (``loss`` only with labels)."""
        check_device_data(data, self.input_shape, self.n_classes, self.float_inputs)
        logits = self.logits(data.x)
        scores = {k: v.tolist() for k, v in rule_scores(logits).items()}
        distances = None if self.descriptor_distances is None else self.descriptor_distances(data.x)
        if distances is not None:
            scores["descriptor"] = [
                float(distances[m]) if m < len(distances) else math.inf for m in self.models
            ]
        accuracy = None
        if data.y is not None:
            y = data.y.to(torch.int64)
            scores["loss"] = [float(self.loss(out, y)) for out in logits]
            accuracy = (logits.argmax(dim=-1) == y).double().mean(dim=1).tolist()
        chosen = {rule: self.models[best(s, rule)] for rule, s in scores.items()}
        return Assignment(
            self.algorithm,
            self.seed,
            data.name,
            data.group,
            len(data.x),
            list(self.models),
            list(self.members),
            scores,
            chosen,
            accuracy,
        )


def _final_state(job: Any, rundir: RunDirectory, name: str, rounds: int) -> Any:
    """The algorithm state of ``job``'s last checkpoint, which must be its last round
    (one :class:`FedclusterError` naming the job otherwise)."""
    found = job.checkpointed(rundir)
    done = 0 if found is None else found[0].round
    if found is None or done != rounds:
        raise FedclusterError(
            f"{name} has not finished (round {done} of {rounds}); resume it first, or pick "
            "finished jobs with --algorithms/--seed"
        )
    return found[1]


@dataclass
class FinishedRun:
    """The cluster models of every finished job of a run directory."""

    path: Path
    jobs: list[ClusterModels] = field(default_factory=list)

    @classmethod
    def load(
        cls,
        path: str | Path,
        algorithms: Sequence[str] | None = None,
        seeds: Sequence[int] | None = None,
        model: nn.Module | None = None,
        federation: Federation | None = None,
        trust: bool = False,
        loss: LossFn | None = None,
    ) -> FinishedRun:
        """Read the final cluster models of the jobs of ``path`` (all, or those of the
        given algorithm labels and seeds); ``model``, ``federation``, ``loss`` and
        ``trust`` as for :func:`fedcluster.resume`. A job that has not finished, or an
        unknown label or seed, is one :class:`FedclusterError`."""
        from fedcluster.experiment.runner import Experiment, Job, checked_config

        path = check_path(path, "RUN")
        if not (path / "config.yaml").is_file():
            raise FedclusterError(f"{path} is not a run directory (no config.yaml)")
        config = checked_config(path, trust, model, federation, loss)
        specs = _select(
            config.algorithms, algorithms, lambda s: s.display_name(), "algorithm", path
        )
        chosen_seeds = _select(config.seeds, seeds, str, "seed", path)
        experiment = Experiment(config, model=model, federation=federation, loss=loss)
        rundir = RunDirectory(path)
        run = RunInfo(path, experiment.config, True)
        out = cls(path)
        for seed in chosen_seeds:
            fed = experiment.federation(seed)
            assert isinstance(fed, Federation)  # rebuilt in this process from the config
            setting, scenario = experiment.setting(fed, seed)
            for spec in specs:
                label = spec.display_name()
                job = Job(experiment, run, spec, seed, setting, (scenario, None))
                state = _final_state(job, rundir, f"{path}: {label} seed {seed}", config.rounds)
                job.channel.set_masks(*scenario.masks(config.rounds))
                rows, model_of_client = job.algorithm.eval_rows(state)
                distances = getattr(job.algorithm, "descriptor_distances", None)
                used = np.asarray(model_of_client)[job.channel.present]
                models, members = np.unique(used[used >= 0], return_counts=True)
                out.jobs.append(
                    ClusterModels(
                        label,
                        seed,
                        rows[torch.as_tensor(models)].detach().cpu(),
                        [int(m) for m in models],
                        [int(c) for c in members],
                        job.backend.layout,
                        loss or resolve_loss(config.train.loss) or F.cross_entropy,
                        tuple(fed.input_shape),
                        fed.n_classes,
                        bool(fed.x_train.is_floating_point()),
                        None if distances is None else partial(distances, state),
                    )
                )
        return out

    def read(self, file: str | Path) -> DeviceData:
        """A device's data file, checked against the run's model input (module doc)."""
        job = self.jobs[0]
        return read_device_data(file, job.input_shape, job.n_classes, job.float_inputs)

    def assign(self, data: DeviceData, record: bool = False) -> list[Assignment]:
        """Every job's choice for ``data``; with ``record``, appended to ``assign.csv``."""
        result = [job.assign(data) for job in self.jobs]
        if record:
            record_assignments(self.path, result)
        return result


def _select(
    items: Sequence[Any],
    wanted: Sequence[Any] | None,
    key: Callable[[Any], str],
    what: str,
    path: Path,
) -> list[Any]:
    """``items`` whose ``key`` is in ``wanted`` (all when None), in run order."""
    if wanted is None:
        return list(items)
    names = {str(key(i)): i for i in items}
    unknown = [str(w) for w in wanted if str(w) not in names]
    if unknown:
        raise FedclusterError(
            f"{path} has no {what} {', '.join(unknown)} (it has {', '.join(names)})"
        )
    return [names[str(w)] for w in dict.fromkeys(wanted)]


def read_device_data(
    file: str | Path, input_shape: tuple[int, ...], n_classes: int, float_inputs: bool = True
) -> DeviceData:
    """A device's ``.npz`` file (module doc), checked: one :class:`DataError` naming the
    file and what is wrong (missing, not a regular file, too big, not a .npz, no ``x``,
    wrong sample shape or type, empty, NaN/Inf or huge values, bad labels)."""
    path = check_path(file, "--data")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"{path}: not a regular file")
    if info.st_size > MAX_DATA_BYTES:
        raise DataError(f"{path}: {info.st_size:,} bytes, more than the {MAX_DATA_BYTES:,} read")
    blob = path.read_bytes()
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            big = [i.filename for i in archive.infolist() if i.file_size > MAX_DATA_BYTES]
        if big:
            raise DataError(f"{path}: {big[0]} decompresses to more than {MAX_DATA_BYTES:,} bytes")
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except DataError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        reason = " ".join(str(exc).split())[:120]
        raise DataError(f"{path}: not a readable .npz of arrays ({reason})") from None
    names = ("x", "y") if "x" in arrays else ("x_test", "y_test")
    if names[0] not in arrays:
        raise DataError(f"{path}: no array 'x' (the samples) among {sorted(arrays) or 'no arrays'}")
    x, y = arrays[names[0]], arrays.get(names[1])
    group = arrays.get("group")
    if group is not None:
        if group.ndim != 0 or group.dtype.kind not in "iu":
            raise DataError(f"{path}: 'group' must be one integer, not {group.dtype} {group.shape}")
        group = int(group)
    if x.dtype.kind not in ("f" if float_inputs else "iu"):
        want = "floating-point" if float_inputs else "integer (token ids)"
        raise DataError(
            f"{path}: '{names[0]}' holds {x.dtype} values; the run's model takes {want}"
        )
    if y is not None and y.dtype.kind not in "iu":
        raise DataError(f"{path}: '{names[1]}' holds {y.dtype} values, not integer labels")
    data = DeviceData(
        torch.from_numpy(x.astype(np.float32 if float_inputs else np.int64, copy=False)),
        None if y is None else torch.from_numpy(y.astype(np.int64, copy=False)),
        group,
        path.name,
    )
    try:
        check_device_data(data, input_shape, n_classes, float_inputs)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    return data


def check_device_data(
    data: DeviceData, input_shape: tuple[int, ...], n_classes: int, float_inputs: bool
) -> None:
    """One :class:`DataError` when ``data`` does not fit the run's model (shape, type,
    at least one sample, labels one per sample) or holds unusable values
    (:func:`~fedcluster.data.screen.bad_samples`)."""
    x, y = data.x, data.y
    if tuple(x.shape[1:]) != tuple(input_shape) or x.ndim < 1:
        raise DataError(
            f"samples of shape {tuple(x.shape[1:])} (x is {tuple(x.shape)}); the run's "
            f"model takes {tuple(input_shape)}: x must be [N, {', '.join(map(str, input_shape))}]"
        )
    if x.is_floating_point() != float_inputs:
        want = "floating-point inputs" if float_inputs else "integer token ids"
        raise DataError(f"x holds {x.dtype} values; the run's model takes {want}")
    if len(x) == 0:
        raise DataError("holds no samples (x has 0 rows)")
    if y is not None and (y.ndim != 1 or len(y) != len(x)):
        raise DataError(f"y has shape {tuple(y.shape)}; give one label per sample ({len(x)})")
    for what, rows in bad_samples(x, y, n_classes, "data"):
        n = int(rows.sum())
        if n:
            first = int(torch.nonzero(rows)[0])
            raise DataError(f"{n} of {len(x)} samples have {what} (first: sample {first})")


def record_assignments(path: Path, assignments: list[Assignment]) -> Path:
    """Append ``assignments`` to the run's ``assign.csv`` (created with its header),
    holding the run directory's lock."""
    rundir = RunDirectory(path)
    file = path / ASSIGN_FILE
    with rundir.lock():
        buffer = io.StringIO(newline="")
        writer = csv.writer(buffer)
        if not os.path.lexists(file):
            writer.writerow(ASSIGN_COLUMNS)
        for a in assignments:
            writer.writerows(a.rows())
        safefiles.append(file, buffer.getvalue())
    return file


def format_assignments(assignments: list[Assignment]) -> str:
    """One table per job: every candidate's score under each rule, the choices marked *."""
    blocks = []
    for a in assignments:
        rules = list(a.scores)
        rows = []
        for i, m in enumerate(a.models):
            row = {"model": str(m), "members": str(a.members[i])}
            for rule in rules:
                mark = "*" if a.chosen[rule] == m else ""
                row[rule] = f"{a.scores[rule][i]:.4f}{mark}"
            if a.accuracy is not None:
                row["accuracy"] = f"{a.accuracy[i]:.4f}"
            rows.append(row)
        chosen = ", ".join(f"{rule} -> model {a.chosen[rule]}" for rule in rules)
        group = "" if a.group is None else f", group {a.group}"
        head = f"{a.algorithm} seed {a.seed} on {a.data} ({a.samples} samples{group}): {chosen}"
        blocks.append(head + "\n" + format_table(rows))
    return "\n\n".join(blocks)


def summarise(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The report's table of ``assign.csv`` rows: per algorithm (in the rows' order) and
    true group (then ``all`` groups), the mean accuracy of each rule's choice over the
    recorded devices and how often each label-free rule chose the labelled rule's model.
    A device recorded again (same algorithm, seed and file name) counts once, as last
    recorded."""
    devices: dict[str, dict[tuple[str, str], dict[str, dict[str, str]]]] = {}
    for r in rows:
        per_device = devices.setdefault(r["algorithm"], {})
        per_device.setdefault((r["seed"], r["data"]), {})[r["rule"]] = r
    out = []
    for algorithm, per_device in devices.items():
        groups = sorted({d[next(iter(d))]["group"] for d in per_device.values()}, key=_group_key)
        parts = [
            (g, [d for d in per_device.values() if d[next(iter(d))]["group"] == g]) for g in groups
        ]
        if len(groups) > 1:
            parts.append(("all", list(per_device.values())))
        out += [_summary_row(algorithm, group or "?", found) for group, found in parts]
    return out


def _group_key(group: str) -> tuple[int, str]:
    return (int(group), "") if group.lstrip("-").isdigit() else (1 << 62, group)


def _summary_row(
    algorithm: str, group: str, found: list[dict[str, dict[str, str]]]
) -> dict[str, str]:
    row = {"algorithm": algorithm, "group": group, "devices": str(len(found))}
    for rule in RULES:
        accs = [_float(d[rule]["accuracy"]) for d in found if rule in d]
        accs = [a for a in accs if not math.isnan(a)]
        row[f"{rule} acc"] = f"{np.mean(accs):.4f}" if accs else ""
    for rule in LABEL_FREE:
        same = [
            d[rule]["model"] == d[rule]["labelled_model"]
            for d in found
            if rule in d and d[rule]["labelled_model"]
        ]
        row[f"{rule} = loss"] = f"{sum(same)}/{len(same)}" if same else ""
    return row


def _float(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan
