"""Sweeps over any config field, with the mean and a 95 % confidence interval per setting.

``fedcluster run|compare ... --sweep FIELD=V1,V2,...`` (repeatable) and
:func:`sweep` vary any field of the config (``train.lr``, ``data.partition.alpha``,
``model.options.hidden``, ``privacy.*``, ``scenario.*``, ``algorithms.<name>.<param>``):

- **grid**: every combination of the listed values. A field other than an
  algorithm's parameter changes the federation, the model or the training, so
  each combination of such fields (a *setting*) is its own run directory,
  built from scratch (``<out>/settings/<i>-<values>``; each run builds its
  federation per seed as a plain run does). An algorithm's parameter with a
  list of values stays within each run, as labelled entries (``jgl(lam=0.1)``,
  :func:`fedcluster.config.overrides.apply_sweeps`), so those are compared on the same
  federations as methods;
- **random search**: ``--sweep 'train.lr=loguniform(1e-3,1e-1)' --trials 8``
  draws ``trials`` settings, every swept field at random: ``uniform(a,b)``,
  ``loguniform(a,b)`` (uniform in log), ``int(a,b)`` (integers a..b inclusive),
  a list (one of its values). The draws come from ``numpy.random.default_rng``
  seeded with ``--sweep-seed`` (default 0), so the same command draws the same
  settings; floats are rounded to 4 significant digits so that settings read
  as they are recorded.

Each setting's jobs (algorithm × seed) give one number each (``metric``,
default the final accuracy of ``summary.json``; a job without it, e.g. one
that never evaluated, is left out and ``seeds`` lists those counted). Per
setting and algorithm the result is the mean over seeds with its Student t
interval, and within a setting every two methods are compared on their common seeds by a paired
t-test (:mod:`fedcluster.stats` says why this test). The sweep directory holds
``summary.json`` (settings, results, paired tests), ``summary.md`` (what the
command prints) and ``report.html`` / ``report.md``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcluster.config import safeyaml
from fedcluster.config.overrides import apply_sweeps, parse_values, run_slug, value_text
from fedcluster.config.schema import ExperimentConfig, apply_set, load_yaml, validate_config
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.experiment import safefiles
from fedcluster.experiment.callbacks import Callback
from fedcluster.experiment.summary import format_table
from fedcluster.reporting.sweep import paired_rows, result_rows
from fedcluster.stats import mean_ci, paired_test

if TYPE_CHECKING:
    from torch import nn

    from fedcluster.data.federation import Federation

_RANGE = re.compile(r"^\s*(uniform|loguniform|int)\s*\(\s*([^,()]+?)\s*,\s*([^,()]+?)\s*\)\s*$")


@dataclass(frozen=True)
class Range:
    """A range of a random search: ``uniform``, ``loguniform`` (a, b > 0) or ``int`` (a..b)."""

    kind: str
    low: float
    high: float

    def draw(self, rng: np.random.Generator) -> float | int:
        if self.kind == "int":
            return int(rng.integers(int(self.low), int(self.high) + 1))
        if self.kind == "loguniform":
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        return float(f"{value:.4g}")

    def __str__(self) -> str:
        return f"{self.kind}({self.low:g},{self.high:g})"


@dataclass(frozen=True)
class Axis:
    """One swept field: its dotted name and a list of values or a :class:`Range`."""

    field: str
    values: tuple[Any, ...] | Range

    @property
    def is_algorithm_param(self) -> bool:
        parts = self.field.split(".")
        return len(parts) == 3 and parts[0] == "algorithms" and not parts[1].isdigit()

    def text(self) -> str:
        """The axis as ``--sweep`` takes it."""
        if isinstance(self.values, Range):
            return f"{self.field}={self.values}"
        return f"{self.field}=" + ",".join(value_text(v) for v in self.values)


def _range(field: str, kind: str, low: Any, high: Any) -> Range:
    where = f"--sweep {field}={kind}(...)"
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)):
        raise ConfigError(f"{where}: the bounds must be numbers")
    if not low < high:
        raise ConfigError(f"{where}: the lower bound {low} must be below the upper {high}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform needs a positive lower bound, not {low}")
    if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        raise ConfigError(f"{where}: int(a,b) needs whole-number bounds")
    return Range(kind, float(low), float(high))


def parse_axis(text: str) -> Axis:
    """``FIELD=v1,v2,...`` or ``FIELD=uniform|loguniform|int(a,b)`` (a ``--sweep`` flag)."""
    field, sep, values = text.partition("=")
    field = field.strip()
    if not sep or not field or not values.strip() or not re.fullmatch(r"[\w.-]+", field):
        raise ConfigError(
            f"--sweep {text!r}: expected FIELD=v1,v2,... or FIELD=loguniform(a,b) "
            "(also uniform(a,b), int(a,b)), e.g. train.lr=0.01,0.05"
        )
    found = _RANGE.match(values)
    if found:
        kind, low, high = found.groups()
        where = f"--sweep {field}: bound"
        return Axis(
            field, _range(field, kind, safeyaml.loads(low, where), safeyaml.loads(high, where))
        )
    return Axis(field, tuple(parse_values(field, values)))


def axes_of(space: Mapping[str, Any] | Sequence[str]) -> list[Axis]:
    """The axes of ``--sweep`` texts or of a mapping ``{field: [values] or "loguniform(a,b)"}``."""
    if isinstance(space, Mapping):
        axes = []
        for field, values in space.items():
            if isinstance(values, str):
                axes.append(parse_axis(f"{field}={values}"))
            elif isinstance(values, Sequence) and len(values) > 0:
                axes.append(Axis(str(field), tuple(values)))
            else:
                raise ConfigError(
                    f"sweep {field}: expected a non-empty list of values or a range text "
                    f"such as 'loguniform(1e-3,1e-1)', not {values!r}"
                )
    else:
        axes = [parse_axis(t) for t in space]
    seen = [a.field for a in axes]
    twice = sorted({f for f in seen if seen.count(f) > 1})
    if twice:
        raise ConfigError(f"--sweep {twice[0]}: swept twice; give its values in one flag")
    return axes


MAX_SETTINGS = 10_000
"""The most settings (runs) of one sweep: grid points or trials."""


def needs_runs(axes: Sequence[Axis], trials: int | None) -> bool:
    """Whether the sweep needs one run per setting (any field but an algorithm's parameter
    list, or a random search); otherwise it is labelled entries of one run."""
    return trials is not None or any(
        isinstance(a.values, Range) or not a.is_algorithm_param for a in axes
    )


def settings_of(
    axes: Sequence[Axis], trials: int | None, seed: int = 0
) -> tuple[list[dict[str, Any]], list[Axis]]:
    """The settings (one dict field -> value per run) and the axes left within each run."""
    if trials is not None:
        if not 1 <= trials <= MAX_SETTINGS:
            raise ConfigError(f"--trials {trials}: give 1 to {MAX_SETTINGS:,} trials")
        if not axes:
            raise ConfigError(f"--trials {trials}: give the fields to draw with --sweep")
        rng = np.random.default_rng(seed)
        settings = []
        for _ in range(trials):
            setting = {}
            for a in axes:
                if isinstance(a.values, Range):
                    setting[a.field] = a.values.draw(rng)
                else:
                    setting[a.field] = a.values[int(rng.integers(len(a.values)))]
            settings.append(setting)
        return settings, []
    ranges = [a.field for a in axes if isinstance(a.values, Range)]
    if ranges:
        raise ConfigError(f"--sweep {ranges[0]}: a range needs --trials N (a random search)")
    within = [a for a in axes if a.is_algorithm_param]
    across = [a for a in axes if not a.is_algorithm_param]
    count = math.prod(len(a.values) for a in across if not isinstance(a.values, Range))
    if count > MAX_SETTINGS:  # the entries of one run: fedcluster.config.overrides
        raise ConfigError(
            f"--sweep: {count:,} settings (runs) in the grid of "
            f"{' × '.join(a.field for a in across)}; at most {MAX_SETTINGS:,} "
            "(a random search, --trials N, draws a sample of a large space)"
        )
    combos = itertools.product(*(a.values for a in across if not isinstance(a.values, Range)))
    return [dict(zip([a.field for a in across], c, strict=True)) for c in combos], within


def setting_label(setting: Mapping[str, Any]) -> str:
    """``field=value, ...`` of a setting, as its tables show it ('' for no swept field)."""
    return ", ".join(f"{k}={value_text(v)}" for k, v in setting.items())


def config_for(
    raw: dict[str, Any], setting: Mapping[str, Any], within: Sequence[Axis]
) -> ExperimentConfig:
    """The validated config of one setting: its values set, then the in-run sweeps."""
    for field, value in setting.items():
        raw = apply_set(raw, f"{field}={value_text(value)}")
    raw = apply_sweeps(raw, [a.text() for a in within])
    return validate_config(raw)


def is_sweep(path: str | Path) -> bool:
    """Whether ``path`` is a sweep directory (its ``summary.json`` lists settings)."""
    try:  # a run directory's summary.json: its own reader names what is wrong with it
        data = json.loads(safefiles.read_bytes(Path(path) / "summary.json"))
    except (OSError, ValueError, RecursionError, FedclusterError):
        return False
    return isinstance(data, dict) and "settings" in data and "results" in data


@dataclass
class SweepResult:
    """A finished sweep, read back from its directory (:func:`sweep`).

    ``settings``: one entry per run (``index``, ``values``, ``run`` directory);
    ``results``: one row per setting × algorithm (``mean``, ``ci_low``,
    ``ci_high``, ``n``, per-seed ``seeds`` and ``values``); ``paired``: every two
    algorithms of a setting on their common seeds (:class:`fedcluster.stats.PairedTest`).
    """

    path: Path
    metric: str
    settings: list[dict[str, Any]]
    results: list[dict[str, Any]]
    paired: list[dict[str, Any]]
    report: Path | None = None

    @classmethod
    def load(cls, path: str | Path, report: Path | None = None) -> SweepResult:
        path = Path(path)
        data = json.loads((path / "summary.json").read_text())
        return cls(path, data["metric"], data["settings"], data["results"], data["paired"], report)

    def table(self) -> str:
        """The printed summary: results, then the paired tests."""
        return format_summary(self.metric, self.results, self.paired)

    def to_pandas(self) -> Any:
        """``results`` as a pandas DataFrame (pandas is not a dependency: install it)."""
        try:
            import pandas as pd
        except ImportError:
            raise ConfigError("SweepResult.to_pandas needs pandas: pip install pandas") from None
        return pd.DataFrame(self.results)


def _number(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def collect(
    settings: list[dict[str, Any]], runs: list[Path], metric: str, confidence: float = 0.95
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Results per setting × algorithm and paired tests, from the runs' ``summary.json``."""
    results, paired = [], []
    for index, (setting, run) in enumerate(zip(settings, runs, strict=True)):
        per: dict[str, dict[int, float]] = {}
        for job in json.loads((run / "summary.json").read_text())["jobs"]:
            value = job[metric]
            seeds = per.setdefault(job["algorithm"], {})
            if value is not None and not math.isnan(float(value)):  # a job without the metric
                seeds[job["seed"]] = float(value)  # (e.g. no evaluation) is left out, not NaN
        label = setting_label(setting)
        for algorithm, by_seed in per.items():
            seed_order = sorted(by_seed)
            if not seed_order:
                continue
            ci = mean_ci([by_seed[s] for s in seed_order], confidence)
            results.append(
                {
                    "setting": index,
                    "values": dict(setting),
                    "label": label,
                    "algorithm": algorithm,
                    "n": ci.n,
                    "mean": _number(ci.mean),
                    "ci_low": _number(ci.low),
                    "ci_high": _number(ci.high),
                    "seeds": seed_order,
                    "per_seed": [by_seed[s] for s in seed_order],
                }
            )
        for a, b in itertools.combinations(per, 2):
            common = sorted(set(per[a]) & set(per[b]))
            if not common:
                continue
            test = paired_test(
                a, [per[a][s] for s in common], b, [per[b][s] for s in common], confidence
            )
            d = test.difference
            paired.append(
                {
                    "setting": index,
                    "label": label,
                    "a": a,
                    "b": b,
                    "n": test.n,
                    "test": "paired t-test",
                    "difference": _number(d.mean),
                    "ci_low": _number(d.low),
                    "ci_high": _number(d.high),
                    "t_p": _number(test.t_p),
                    "wilcoxon_p": _number(test.wilcoxon_p),
                }
            )
    return results, paired


def format_summary(metric: str, results: list[dict[str, Any]], paired: list[dict[str, Any]]) -> str:
    text = f"{metric}: mean over seeds with its 95% Student t interval\n\n"
    text += format_table(result_rows(results)) + "\n"
    if paired:
        text += "\npaired t-test between methods on the same seeds (Wilcoxon from 6 seeds)\n\n"
        text += format_table(paired_rows(paired)) + "\n"
    return text


def _raw(config: ExperimentConfig | Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, ExperimentConfig):
        return config.model_dump(mode="json")
    if isinstance(config, str | Path):
        return load_yaml(config)
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(
        f"sweep: config must be an ExperimentConfig, a mapping or a YAML path, not {config!r}"
    )


def check_metric(metric: str) -> None:
    """A one-line error unless ``metric`` is a per-job column of a run's ``summary.json``."""
    from fedcluster.experiment.rundir import JobResult, job_summary

    known = [k for k in job_summary(JobResult("", 0, [], 0.0)) if k not in ("algorithm", "seed")]
    if metric not in known:
        raise ConfigError(f"sweep metric {metric!r}: not one of {', '.join(known)}")


def run_sweep(
    raw: dict[str, Any],
    axes: Sequence[Axis],
    out: Path,
    *,
    trials: int | None = None,
    seed: int = 0,
    metric: str = "final_accuracy",
    run: Callable[[ExperimentConfig, Path], None],
    report: bool = True,
) -> SweepResult:
    """Run one experiment per setting under ``out/settings/`` (``run(config, dir)``), then write
    ``out/summary.json``, ``summary.md`` and the reports (each setting's and the sweep's).
    Every setting's config is validated before the first run starts, so a bad value
    stops the sweep in one line."""
    check_metric(metric)
    settings, within = settings_of(axes, trials, seed)
    configs = [config_for(raw, s, within) for s in settings]
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"sweep: {out} exists and is not an empty directory; choose a new --out")
    runs = []
    for i, (setting, config) in enumerate(zip(settings, configs, strict=True)):
        slug = run_slug([f"{f}={value_text(v)}" for f, v in setting.items()]) or "base"
        runs.append(out / "settings" / f"{i:02d}-{slug}")
        run(config, runs[-1])
        if report:
            from fedcluster.reporting import write_report

            write_report([runs[-1]])
    results, paired = collect(settings, runs, metric)
    data = {
        "name": configs[0].name,
        "mode": "random" if trials is not None else "grid",
        "axes": [a.text() for a in axes],
        "trials": trials,
        "sweep_seed": seed if trials is not None else None,
        "metric": metric,
        "confidence": 0.95,
        "settings": [
            {"index": i, "values": s, "label": setting_label(s), "run": str(r.relative_to(out))}
            for i, (s, r) in enumerate(zip(settings, runs, strict=True))
        ],
        "results": results,
        "paired": paired,
    }
    safefiles.write_atomic(out / "summary.json", json.dumps(data, indent=2, allow_nan=False))
    safefiles.write_atomic(out / "summary.md", format_summary(metric, results, paired))
    path = None
    if report:
        from fedcluster.reporting.sweep import write_sweep_report

        path = write_sweep_report(out)
    return SweepResult.load(out, path)


def sweep(
    config: ExperimentConfig | Mapping[str, Any] | str | Path,
    space: Mapping[str, Any],
    *,
    out: str | Path | None = None,
    trials: int | None = None,
    seed: int = 0,
    metric: str = "final_accuracy",
    model: nn.Module | None = None,
    federation: Federation | None = None,
    callbacks: Sequence[Callback] = (),
    report: bool = True,
    progress: bool = False,
) -> SweepResult:
    """Run ``config`` once per setting of ``space`` and compare its methods over seeds.

    Args:
        config: an :class:`ExperimentConfig`, a mapping of its fields or a YAML file.
        space: ``{field: [values]}`` (a grid) or ``{field: "loguniform(1e-3,1e-1)"}``
            (``uniform``, ``int`` too; needs ``trials``), e.g. ``{"train.lr": [0.01, 0.05]}``.
        out: the sweep directory (default ``runs/<name>-sweep-<timestamp>``); new or empty.
        trials, seed: a random search of ``trials`` settings drawn with ``seed``.
        metric: the ``summary.json`` column compared (``final_accuracy``, ``best_accuracy``).
        model, federation, callbacks: objects every setting uses (as for
            :func:`fedcluster.run`); a factory is named in the config instead
            (``model.name: "pkg.module:factory"``, ``data.federation``), which a
            sweep of model or data fields needs.
        report, progress: the sweep's ``report.html``; progress bars.

    Returns:
        The sweep directory read back (:class:`SweepResult`).
    """
    from datetime import datetime

    from fedcluster.experiment.runner import Experiment

    raw = _raw(config)
    axes = axes_of(space)
    for given, section, where in (
        (model, "model", "model.name"),
        (federation, "data", "data.federation"),
    ):
        swept = [a.field for a in axes if a.field.startswith(f"{section}.")]
        if given is not None and swept:
            raise ConfigError(
                f"sweep {swept[0]}: the {section} is given as an object, which every setting "
                f"would use; name a factory by import path in {where} instead"
            )
    name = validate_config(raw).name

    def run_one(cfg: ExperimentConfig, where: Path) -> None:
        Experiment(cfg, model=model, federation=federation, callbacks=callbacks).run(
            where, progress=progress
        )

    sweep_dir = Path(out or f"runs/{name}-sweep-{datetime.now():%Y%m%d-%H%M%S}")
    return run_sweep(
        raw, axes, sweep_dir, trials=trials, seed=seed, metric=metric, run=run_one, report=report
    )
