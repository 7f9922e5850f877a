"""A leaderboard: every method on every scenario of a suite over seeds, in one table.

``fedcluster benchmark SUITE`` runs a *suite* (a YAML file, or a built-in one from
``fedcluster/config/suites``): a base experiment config, the methods (``all``: every
registered algorithm, each with the suite's ``params`` for it, so methods added to
the package join by themselves) and the scenarios, each a set of config fields
(e.g. ``data.shift``, :mod:`fedcluster.data.shift`; ``scenario.drift`` for the drift
track). Each scenario is one run directory, ``<out>/<i>-<name>``, holding its
(method, seed) jobs; a killed benchmark started again with the same ``--out``
resumes every job from its own checkpoint (:func:`fedcluster.experiment.runner.resume`)
and reads the finished scenarios (those with a ``summary.json``) back as they are.

Two tracks besides plain training:

- **unseen clients** (``unseen: N``): the last N clients never join
  (``scenario.joins``: after the last round), so no method trains on them or
  evaluates them; after training each one picks a model of the job label-free, by
  the lowest mean prediction entropy on its test data
  (:mod:`fedcluster.experiment.cluster_choice`), and its accuracy with that model is
  reported apart -- the test-time protocol of FLUX (Fenoglio et al., "FLUX:
  Efficient Descriptor-Driven Clustered Federated Learning under Arbitrary
  Distribution Shifts", NeurIPS 2025: clients unseen in training, without labels,
  matched to a cluster model at test time);
- **drift**: a scenario with ``scenario.drift`` events, clients changing their
  distribution at given rounds, and with ``regroup`` their ground-truth group, as
  the clients of FedDrift's experiments change concept (Jothimurugesan et al.,
  "Federated Learning under Distributed Concept Drift", AISTATS 2023).

Per (scenario, method) the table gives the final accuracy's mean over seeds and its
95 % Student t interval (:func:`fedcluster.stats.mean_ci`), the paired t-test
against the scenario's best method on their common seeds
(:func:`fedcluster.stats.paired_test`), the mean accuracy of the worst 10 % of
clients at the last evaluation (``clients.csv``), the clustering's ARI against the
ground-truth groups, the bytes sent both ways, and the unseen clients' accuracy;
each a mean over seeds. ``<out>`` gets ``leaderboard.json`` (with the per-seed
values), ``leaderboard.md`` and ``report.html``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedcluster.config.overrides import value_text
from fedcluster.config.schema import (
    EXECUTION_FIELDS,
    RECORD_KEY,
    ExperimentConfig,
    apply_set,
    deep_merge,
    describe_error,
    load_preset,
    load_yaml,
    validate_config,
    with_execution,
)
from fedcluster.config.suites import list_suites
from fedcluster.errors import ConfigError
from fedcluster.experiment import health, safefiles
from fedcluster.experiment.client_results import read_clients
from fedcluster.experiment.rundir import RunDirectory, event_lines
from fedcluster.reporting.clients import WORST_FRACTION, worst_rows
from fedcluster.reporting.document import Section
from fedcluster.reporting.figures import _subplots, png
from fedcluster.reporting.writers import write_html, write_markdown
from fedcluster.stats import mean_ci, paired_test

__all__ = ["BenchmarkResult", "Suite", "list_suites", "load_suite", "run_benchmark"]

log = logging.getLogger(__name__)

UNSEEN_RULE = "entropy"
"""The label-free rule by which an unseen client picks its model."""


class ScenarioSpec(BaseModel):
    """One scenario of a suite: config fields set on the base config."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    set: dict[str, Any] = Field(default_factory=dict, description="dotted field -> value")
    unseen: int = Field(0, ge=0, description="the last N clients are never trained")


class Suite(BaseModel):
    """A benchmark suite (module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    preset: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    methods: Literal["all"] | list[str] = "all"
    exclude: list[str] = Field(default_factory=list)
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    scenarios: list[ScenarioSpec] = Field(min_length=1)

    @field_validator("scenarios")
    @classmethod
    def _unique_names(cls, scenarios: list[ScenarioSpec]) -> list[ScenarioSpec]:
        names = [s.name for s in scenarios]
        twice = [n for n in names if names.count(n) > 1]
        if twice:
            raise ValueError(f"two scenarios are named {twice[0]!r}; give each its own name")
        return scenarios

    def method_names(self) -> list[str]:
        """The methods run: every registered algorithm (``all``) or those listed, less
        ``exclude``."""
        from fedcluster.algorithms import ALGORITHMS

        names = sorted(ALGORITHMS) if self.methods == "all" else list(self.methods)
        unknown = [n for n in [*names, *self.exclude, *self.params] if n not in ALGORITHMS]
        if unknown:
            raise ConfigError(
                f"suite {self.name!r}: unknown method {unknown[0]!r}; "
                f"registered: {', '.join(sorted(ALGORITHMS))}"
            )
        return [n for n in names if n not in self.exclude]

    def config_for(self, scenario: ScenarioSpec) -> ExperimentConfig:
        """The validated config of one scenario: base, scenario fields, methods, unseen."""
        raw: dict[str, Any] = load_preset(self.preset) if self.preset else {}
        raw = {**deep_merge(raw, self.config), "name": f"{self.name}-{scenario.name}"}
        raw["algorithms"] = [
            {"name": n, "label": n, "params": self.params.get(n, {})} for n in self.method_names()
        ]
        for field, value in scenario.set.items():
            raw = apply_set(raw, f"{field}={value_text(value)}")
        if scenario.unseen:
            rounds = validate_config(raw).rounds
            raw = apply_set(raw, f"scenario.joins.rounds={[rounds + 1] * scenario.unseen}")
        return validate_config(raw)


def load_suite(name_or_path: str | Path) -> Suite:
    """A suite from a YAML file, or a built-in one by name; one line when it is invalid."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        try:
            text = safefiles.read_bytes(path).decode()
        except OSError as exc:
            raise ConfigError(f"suite {path}: {exc.strerror or exc}") from None
        where = str(path)
    else:
        if str(name_or_path) not in list_suites():
            raise ConfigError(
                f"unknown suite {str(name_or_path)!r}; built in: {', '.join(list_suites())}"
            )
        text = (resources.files("fedcluster.config.suites") / f"{name_or_path}.yaml").read_text()
        where = f"suite {name_or_path}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not YAML ({str(exc).splitlines()[0]})") from None
    try:
        return Suite.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{where}: {describe_error(dict(first), 'suite')}") from None


@dataclass
class BenchmarkResult:
    """A finished benchmark read back: one row per (scenario, method), ``report`` its page."""

    path: Path
    rows: list[dict[str, Any]]
    report: Path

    def table(self) -> str:
        """The leaderboard as Markdown."""
        return (self.path / "leaderboard.md").read_text()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "scenario"


def run_benchmark(
    suite: Suite, out: str | Path, *, jobs: int | None = None, progress: bool = False
) -> BenchmarkResult:
    """Run (or resume) every scenario of ``suite`` under ``out`` and write the leaderboard."""
    from fedcluster.experiment.runner import Experiment, resume

    out = Path(out)
    configs = [suite.config_for(s) for s in suite.scenarios]  # every one checked first
    rows: list[dict[str, Any]] = []
    for i, (scenario, config) in enumerate(zip(suite.scenarios, configs, strict=True)):
        run_dir = out / f"{i:02d}-{_slug(scenario.name)}"
        execution = {} if jobs is None else {"jobs": jobs}
        if (run_dir / "config.yaml").is_file():
            _check_same(run_dir, config)
            if not (run_dir / "summary.json").is_file():  # written once every job has ended
                resume(run_dir, progress=progress, execution=execution)
        else:
            Experiment(with_execution(config, **execution)).run(run_dir, progress=progress)
        rows += scenario_rows(scenario.name, run_dir, config, scenario.unseen)
    return write_leaderboard(out, suite.name, rows)


def _check_same(run_dir: Path, config: ExperimentConfig) -> None:
    """A :class:`ConfigError` when ``run_dir`` was run with another config than the
    suite's for its scenario (a changed suite written into the same ``--out``)."""
    raw = load_yaml(run_dir / "config.yaml")
    raw.pop(RECORD_KEY, None)
    found = validate_config(raw).model_dump(exclude=set(EXECUTION_FIELDS))
    wanted = config.model_dump(exclude=set(EXECUTION_FIELDS))
    differ = [k for k in wanted if found.get(k) != wanted[k]]
    if differ:
        raise ConfigError(
            f"{run_dir} was run with another {differ[0]!r} than the suite gives its scenario; "
            "run the changed suite with a new --out"
        )


def _job_values(run_dir: Path) -> dict[tuple[str, int], dict[str, float | None]]:
    """Per (method, seed): final accuracy, ARI, bytes both ways and worst-10% accuracy."""
    summary = json.loads(safefiles.read_bytes(run_dir / "summary.json"))
    clients = read_clients(run_dir)
    last = clients.groupby(["algorithm", "seed"])["round"].transform("max")
    final = clients[clients["round"] == last]
    values: dict[tuple[str, int], dict[str, float | None]] = {}
    for job in summary["jobs"]:
        key = (str(job["algorithm"]), int(job["seed"]))
        mine = final[(final["algorithm"] == key[0]) & (final["seed"] == key[1])]
        worst = worst_rows(mine, WORST_FRACTION)["accuracy"].mean() if len(mine) else None
        values[key] = {
            "accuracy": job["final_accuracy"],
            "ari": job["final_ari"],
            "megabytes": (job["bytes_up"] + job["bytes_down"]) / 1e6,
            "worst": None if worst is None else float(worst),
        }
    return values


def unseen_accuracy(
    run_dir: Path, config: ExperimentConfig, count: int
) -> dict[tuple[str, int], float]:
    """Per (method, seed): the mean accuracy of the last ``count`` clients (never trained)
    with the model each picks by :data:`UNSEEN_RULE` on its test data."""
    from fedcluster.data.configured import build_federation_for
    from fedcluster.experiment.cluster_choice import LABEL_FREE, DeviceData, FinishedRun

    finished = FinishedRun.load(run_dir)
    out: dict[tuple[str, int], float] = {}
    for seed in config.seeds:
        fed = build_federation_for(config, seed)
        devices = []
        for c in range(fed.n_clients - count, fed.n_clients):
            rows = fed.client_slice(c, "test")
            group = None if fed.groups is None else int(fed.groups[c])
            devices.append(DeviceData(fed.x_test[rows], fed.y_test[rows], group, f"client {c}"))
        for job in (j for j in finished.jobs if j.seed == seed):
            chosen = [job.assign(d) for d in devices if len(d.x)]
            accuracy = [a.chosen_accuracy(UNSEEN_RULE) for a in chosen]
            known = [a for a in accuracy if a is not None]
            if known:  # unseen clients without test samples have no accuracy
                out[(job.algorithm, seed)] = float(np.mean(known))
            _record_warnings(run_dir, config.rounds, health.same_model(chosen, LABEL_FREE))
    return out


def _record_warnings(run_dir: Path, rnd: int, found: list[tuple[str, int, str]]) -> None:
    """Log each warning and add it to ``events.csv`` unless it is there already (a
    benchmark read back again)."""
    rundir = RunDirectory(run_dir)
    known = set()
    if rundir.events.is_file():
        with rundir.events.open(newline="") as f:
            known = {(r["algorithm"], r["seed"], r["detail"]) for r in csv.DictReader(f)}
    for algorithm, seed, line in found:
        log.warning("%s seed %d: %s", algorithm, seed, line)
        if (algorithm, str(seed), line) not in known:
            events = [(health.NO_CLIENT, health.WARNING, line)]
            rundir.append(rundir.events, event_lines(algorithm, seed, rnd, events))


def scenario_rows(
    name: str, run_dir: Path, config: ExperimentConfig, unseen: int
) -> list[dict[str, Any]]:
    """The leaderboard rows of one scenario's run directory."""
    values = _job_values(run_dir)
    if unseen:
        for key, acc in unseen_accuracy(run_dir, config, unseen).items():
            values[key]["unseen"] = acc
    methods = list(dict.fromkeys(m for m, _ in values))
    accuracy: dict[str, dict[int, float]] = {m: {} for m in methods}
    for (m, seed), v in values.items():
        if v["accuracy"] is not None:
            accuracy[m][seed] = float(v["accuracy"])
    scored = [m for m in methods if accuracy[m]]
    best = max(scored, key=lambda m: float(np.mean(list(accuracy[m].values())))) if scored else None
    return [_row(name, m, accuracy, best, values) for m in methods]


def _row(
    scenario: str,
    method: str,
    accuracy: dict[str, dict[int, float]],
    best: str | None,
    values: dict[tuple[str, int], dict[str, float | None]],
) -> dict[str, Any]:
    """One leaderboard row: the method's per-seed accuracies, their mean and interval, the
    paired test against ``best`` and the other columns' means over seeds."""
    mine = accuracy[method]
    seeds = sorted(mine)
    ci = mean_ci([mine[s] for s in seeds]) if seeds else None
    p = None
    if best is not None and method != best:
        common = sorted(set(seeds) & set(accuracy[best]))
        if len(common) >= 2:
            theirs = accuracy[best]
            test = paired_test(method, [mine[s] for s in common], best, [theirs[s] for s in common])
            p = _finite(test.t_p)
    return {
        "scenario": scenario,
        "method": method,
        "seeds": seeds,
        "accuracy": [mine[s] for s in seeds],
        "mean": None if ci is None else _finite(ci.mean),
        "ci_low": None if ci is None else _finite(ci.low),
        "ci_high": None if ci is None else _finite(ci.high),
        "best": method == best,
        "p_vs_best": p,
        **{
            k: _mean([values[(method, s)].get(k) for s in seeds])
            for k in ("worst", "ari", "megabytes", "unseen")
        },
    }


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _mean(values: list[Any]) -> float | None:
    known = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return float(np.mean(known)) if known else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The leaderboard as text: percentages, the interval in brackets, the best marked."""
    return [
        {
            "scenario": r["scenario"],
            "method": r["method"] + (" (best)" if r["best"] else ""),
            "seeds": str(len(r["seeds"])),
            "accuracy %": _pct(r["mean"]),
            "95% CI": f"[{_pct(r['ci_low'])}, {_pct(r['ci_high'])}]",
            "p vs best": "–" if r["p_vs_best"] is None else f"{r['p_vs_best']:.3g}",
            "worst 10% %": _pct(r["worst"]),
            "ARI": "–" if r["ari"] is None else f"{r['ari']:.2f}",
            "MB": "–" if r["megabytes"] is None else f"{r['megabytes']:.1f}",
            "unseen %": _pct(r["unseen"]),
        }
        for r in rows
    ]


def leaderboard_figure(rows: list[dict[str, Any]]) -> bytes | None:
    """One panel per scenario: each method's mean accuracy (%) as a bar with its 95%
    interval, the best method's bar in another colour. None without results."""
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    if not any(r["mean"] is not None for r in rows):
        return None
    fig, axes = _subplots(
        1,
        len(scenarios),
        figsize=(2.6 * len(scenarios) + 1.5, 0.28 * len(methods) + 1.5),
        sharey=True,
        squeeze=False,
        constrained_layout=True,
    )
    by_key = {(r["scenario"], r["method"]): r for r in rows}
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for i, method in enumerate(methods):
            r = by_key.get((scenario, method))
            if r is None or r["mean"] is None:
                continue
            mean = 100 * r["mean"]
            low = 0.0 if r["ci_low"] is None else mean - 100 * r["ci_low"]
            high = 0.0 if r["ci_high"] is None else 100 * r["ci_high"] - mean
            colour = "tab:orange" if r["best"] else "tab:blue"
            ax.barh(i, mean, xerr=[[low], [high]], color=colour, capsize=2)
        ax.set_title(scenario, fontsize="small")
        ax.set_xlabel("accuracy %")
        ax.set_xlim(0, 100)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(methods)), methods, fontsize="small")
    axes[0][0].invert_yaxis()
    return png(fig)


def write_leaderboard(out: Path, name: str, rows: list[dict[str, Any]]) -> BenchmarkResult:
    """``leaderboard.json``, ``leaderboard.md`` and ``report.html`` of ``rows`` under ``out``."""
    safefiles.write_atomic(
        out / "leaderboard.json", json.dumps({"suite": name, "rows": rows}, indent=2)
    )
    section = Section(
        "leaderboard",
        "Leaderboard",
        "Final accuracy: mean over seeds and its 95% Student t interval; p vs best: paired "
        "t-test against the scenario's best method on their common seeds; worst 10%: mean "
        "accuracy of the worst tenth of clients at the last evaluation; ARI: the clusters "
        "against the ground-truth groups; MB: bytes sent both ways; unseen: accuracy of the "
        "clients never trained, each with the model of lowest prediction entropy on its data. "
        "Each a mean over seeds. The figure: the mean accuracy with its interval, the "
        "scenario's best method in orange.",
        image=leaderboard_figure(rows),
        tables=[("", table_rows(rows))],
    )
    title = f"fedcluster benchmark: {name}"
    subtitle = f"Benchmark directory {out}; one run directory per scenario, each with its report."
    write_markdown(out / "leaderboard.md", title, subtitle, [section])
    write_html(out / "report.html", title, subtitle, [section])
    return BenchmarkResult(out, rows, out / "report.html")
