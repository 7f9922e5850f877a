"""Command-line interface: ``fedcluster run | compare | resume | report | assign | list | show |
verify | flower``."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from fedcluster import __version__
from fedcluster.config.limits import check_path
from fedcluster.errors import FedclusterError
from fedcluster.openmp import prefer_passive_wait

if TYPE_CHECKING:
    from fedcluster.config.schema import ExperimentConfig


DEBUG_ENV = "FEDCLUSTER_DEBUG"
"""Set to 1, the environment variable that does what ``--debug`` does."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="experiment YAML (default: the quickstart preset)")
    p.add_argument("--preset", help="start from a named preset (see `fedcluster list`)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.lr=0.1 or "
        "--set algorithms.ifca.n_clusters=3 (repeatable)",
    )
    p.add_argument("--rounds", type=int, help="communication rounds")
    p.add_argument("--data-dir", help="dataset root (default $FEDCLUSTER_DATA or the user cache)")
    p.add_argument(
        "--download", action="store_true", help="fetch a missing dataset (sets data.download)"
    )
    p.add_argument(
        "--out", help="run directory (default runs/<name>[-<what --set changed>]-<timestamp>)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run directory --out if it exists (default: keep it and write "
        "to the first free OUT-2, OUT-3, ...)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _report_flags(p)
    _jobs_flag(p)


def _jobs_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--jobs",
        type=int,
        help="run the (algorithm, seed) jobs over N local worker processes "
        "(sets jobs; the run directory equals a sequential run's)",
    )


def _distributed_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers",
        type=int,
        help="--backend distributed: worker processes the clients are sharded over (default 2)",
    )
    p.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="--backend distributed: the rendezvous (default a free port on 127.0.0.1; "
        "under torchrun its MASTER_ADDR:MASTER_PORT)",
    )


def _sweep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sweep",
        dest="sweeps",
        action="append",
        default=[],
        metavar="FIELD=V1,V2,...",
        help="run once per value of any config field, e.g. train.lr=0.01,0.05 or "
        "data.partition.alpha=0.1,1 (repeatable: a grid); an algorithm's parameter "
        "(algorithms.jgl.lam=0.1,0.5) gives labelled entries of each run; a range "
        "FIELD=loguniform(A,B), uniform(A,B) or int(A,B) needs --trials. Prints each "
        "setting's mean over seeds with a 95%% confidence interval and paired t-tests",
    )
    p.add_argument(
        "--trials",
        type=int,
        help="random search: draw this many settings from the --sweep ranges and lists",
    )
    p.add_argument(
        "--sweep-seed", type=int, default=0, help="seed of the random search's draws (default 0)"
    )


def _report_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-report", action="store_true", help="do not write report.html at the end")
    p.add_argument(
        "--tensorboard", metavar="DIR", help="also log each round's metrics to TensorBoard in DIR"
    )


def _algorithms_flag(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--algorithms",
        required=required,
        help="comma-separated algorithm names or labels, e.g. jgl,ifca,fedavg (the preset's "
        "entries keep their parameters), import paths (mypkg.cfl:MyMethod) or installed "
        "plugins (`fedcluster list algorithms`)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedcluster",
        description="Clustered federated learning: JGL, CFLGT, DCFL, FedGroup and baselines.",
    )
    parser.add_argument("--version", action="version", version=f"fedcluster {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="after an error's one line, print its traceback, causes included (also "
        f"{DEBUG_ENV}=1): what a plugin, model or loss raised, for a bug report",
    )
    sub = parser.add_subparsers(dest="command")
    _run_parsers(sub)
    _resume_parser(sub)
    _report_parser(sub)
    _assign_parser(sub)
    _benchmark_parser(sub)
    _catalog_parsers(sub)
    _flower_parsers(sub)
    ver = sub.add_parser("verify", help="check local dataset files against pinned SHA-256 sums")
    ver.add_argument("--data-dir", help="dataset root (default $FEDCLUSTER_DATA or the user cache)")
    return parser


def _run_parsers(sub: argparse._SubParsersAction) -> None:
    """``run`` and ``compare``."""
    run = sub.add_parser("run", help="run an experiment and write its run directory")
    _common(run)
    run.add_argument("--seed", type=int, help="random seed")
    _algorithms_flag(run)
    _sweep_flags(run)
    run.add_argument(
        "--backend",
        choices=("simulator", "distributed", "flower"),
        help="run the client computations in the batched simulator (default), sharded "
        "over torch.distributed worker processes (distributed, docs/scale-out.md), or on "
        "Flower's simulation engine, one SuperNode per client (needs `pip install "
        "'fedcluster[flower]'`)",
    )
    _distributed_flags(run)

    compare = sub.add_parser("compare", help="run several algorithms on the same federation")
    _common(compare)
    _algorithms_flag(compare, required=True)
    _sweep_flags(compare)
    compare.add_argument("--seeds", type=int, default=1, help="number of seeds (0..N-1)")


def _benchmark_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "benchmark",
        help="every method on every scenario of a suite over seeds: one leaderboard "
        "(fedcluster.benchmark)",
    )
    bench.add_argument("suite", help="a suite YAML file or a built-in suite's name")
    bench.add_argument(
        "--out", help="benchmark directory (default runs/<suite>); run again to resume"
    )
    bench.add_argument(
        "--methods", help="comma-separated methods instead of the suite's (default: its methods)"
    )
    bench.add_argument("--quiet", action="store_true")
    _jobs_flag(bench)


def _resume_parser(sub: argparse._SubParsersAction) -> None:
    res = sub.add_parser("resume", help="continue a killed run from its checkpoints")
    res.add_argument("dir", help="run directory")
    res.add_argument("--quiet", action="store_true")
    res.add_argument(
        "--trust",
        action="store_true",
        help="import the code the run's config.yaml names (model.name 'pkg.module:factory') "
        "even when no checkpoint shows the run started with it",
    )
    _report_flags(res)
    _jobs_flag(res)
    res.add_argument(
        "--backend",
        choices=("simulator", "distributed"),
        help="where the resumed jobs' client computations run (default: the simulator)",
    )
    _distributed_flags(res)


def _report_parser(sub: argparse._SubParsersAction) -> None:
    rep = sub.add_parser("report", help="write report.html and report.md of one or more runs")
    rep.add_argument(
        "runs", nargs="+", metavar="RUN", help="run directories (or one sweep directory)"
    )
    rep.add_argument(
        "--out", help="report folder (default: the run directory; needed for several runs)"
    )


def _assign_parser(sub: argparse._SubParsersAction) -> None:
    asg = sub.add_parser(
        "assign",
        help="which cluster model of a finished run a device should use for its (unlabelled) data",
    )
    asg.add_argument("run", metavar="RUN", help="run directory of a finished run")
    asg.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help=".npz with x [N, *input shape], optionally y (labels) and group (an integer); "
        "or a client file of `fedcluster flower export` (x_test, y_test)",
    )
    asg.add_argument(
        "--algorithms",
        help="comma-separated labels of the run's algorithms (as in metrics.csv); default: all",
    )
    asg.add_argument("--seed", type=int, help="only this seed's jobs (default: every seed)")
    asg.add_argument("--json", action="store_true", help="print the choices as JSON")
    asg.add_argument(
        "--record",
        action="store_true",
        help="append the choices to RUN/assign.csv (shown by `fedcluster report`)",
    )
    asg.add_argument(
        "--trust", action="store_true", help="import the code config.yaml names (as resume)"
    )


def _catalog_parsers(sub: argparse._SubParsersAction) -> None:
    """``list`` and ``show``."""
    lst = sub.add_parser(
        "list", help="what each algorithm, dataset, partition, model, preset, suite is"
    )
    lst.add_argument(
        "section",
        nargs="?",
        choices=("algorithms", "datasets", "partitions", "models", "presets", "suites"),
        help="only this section",
    )

    show = sub.add_parser("show", help="print a preset's resolved config (YAML)")
    show.add_argument("preset", help="preset name (see `fedcluster list presets`)")
    show.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")


def _flower_parsers(sub: argparse._SubParsersAction) -> None:
    """``fedcluster flower export | app | status | local`` (docs/flower.md)."""
    flower = sub.add_parser(
        "flower", help="deploy on real Flower nodes (export, app, status, local)"
    )
    fsub = flower.add_subparsers(dest="flower_command")
    export = fsub.add_parser("export", help="write each client's data as a node-local file")
    _common(export)
    export.add_argument("--seed", type=int, help="the seed whose partition to export")
    export.add_argument("--nodes", type=int, help="also write node-K/ folders for N nodes")
    app = fsub.add_parser("app", help="write a Flower App folder for `flwr run`")
    app.add_argument("dir", help="the app folder to write")
    _common(app)
    app.add_argument("--seed", type=int, help="random seed")
    app.add_argument(
        "--manifest", help="the export's manifest.json: the server checks the nodes' files"
    )
    status = fsub.add_parser("status", help="a deployed run's final status (exit 1: failed)")
    status.add_argument("run", help="the run directory (the app's `out`)")
    local = fsub.add_parser("local", help="run on a SuperLink and N SuperNodes on loopback")
    _common(local)
    local.add_argument("--seed", type=int, help="random seed")
    local.add_argument(
        "--nodes", type=int, required=True, help="number of SuperNodes (clients spread over them)"
    )
    local.add_argument("--tls", action="store_true", help="TLS with a throwaway CA")
    local.add_argument("--auth", action="store_true", help="SuperNode authentication")
    local.add_argument("--timeout", type=float, help="stop the run after this many seconds")
    local.add_argument(
        "--isolation",
        choices=("process", "subprocess"),
        default="process",
        help="process: one long-lived ClientApp worker per node (default); subprocess: "
        "Flower's default, a fresh ClientApp process per message",
    )


def _overrides(args: argparse.Namespace) -> dict:
    over: dict = {}
    if args.rounds is not None:
        over["rounds"] = args.rounds
    if args.data_dir is not None:
        over["data"] = {"data_dir": args.data_dir}
    if getattr(args, "seed", None) is not None:
        over["seeds"] = [args.seed]
    if getattr(args, "seeds", None) is not None and args.command == "compare":
        over["seeds"] = list(range(args.seeds))
    if args.download:
        over.setdefault("data", {})["download"] = True
    return {**over, **_execution(args)}


def _execution(args: argparse.Namespace) -> dict:
    """The execution fields (config.EXECUTION_FIELDS) the flags set."""
    flags = {
        "jobs": args.jobs,
        "backend": getattr(args, "backend", None),
        "workers": getattr(args, "workers", None),
        "address": getattr(args, "address", None),
    }
    if flags["backend"] == "flower":
        del flags["backend"]
    return {k: v for k, v in flags.items() if v is not None}


def _algorithm_names(args: argparse.Namespace) -> list[str] | None:
    text = getattr(args, "algorithms", None)
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise FedclusterError(f"--algorithms {text!r}: give at least one algorithm name")
    return names


def _run(args: argparse.Namespace) -> int:
    from fedcluster.config.overrides import run_slug
    from fedcluster.config.schema import resolve_config
    from fedcluster.experiment.rundir import fresh_run_path
    from fedcluster.experiment.runner import Experiment
    from fedcluster.sweeps import axes_of, needs_runs

    if needs_runs(axes_of(args.sweeps), args.trials):
        return _sweep(args)
    config = resolve_config(
        args.config,
        args.preset,
        args.sets,
        _overrides(args),
        algorithms=_algorithm_names(args),
        sweeps=args.sweeps,
    )
    if config.backend == "distributed" and _serves():
        return 0
    slug = run_slug(args.sets, getattr(args, "algorithms", None), args.sweeps)
    name = f"{config.name}-{slug}" if slug else config.name
    out = check_path(args.out or f"runs/{name}-{datetime.now():%Y%m%d-%H%M%S}", "--out")
    if out.exists() and not out.is_dir():
        raise FedclusterError(f"--out {out} is an existing file, not a directory")
    out = fresh_run_path(out, args.overwrite)
    print(f"fedcluster: {config.name} -> {out}", file=sys.stderr)
    callbacks = _callbacks(args)
    # a run that fails before its first checkpoint removes the directory it created
    # (RunDirectory.claim), so the same command can run again
    with _stops_are_resumable(out):
        if getattr(args, "backend", "simulator") == "flower":
            if callbacks:
                raise FedclusterError("--tensorboard works with the simulator backend only")
            _run_flower(config, out, progress=not args.quiet)
        else:
            Experiment(config, callbacks=callbacks).run(out, progress=not args.quiet)
    from fedcluster.experiment.summary import print_summary

    print_summary(out)
    if args.sweeps and len(config.seeds) > 1:  # the swept entries, compared over seeds
        from fedcluster.sweeps import collect, format_summary

        print()
        print(format_summary("final_accuracy", *collect([{}], [out], "final_accuracy")), end="")
    _report(args, out)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """``--sweep`` over fields other than an algorithm's parameters: one run per setting
    (:mod:`fedcluster.sweeps`), then the table of means with confidence intervals."""
    from fedcluster.config.overrides import run_slug
    from fedcluster.config.schema import resolve_config
    from fedcluster.experiment.runner import Experiment
    from fedcluster.sweeps import axes_of, run_sweep

    if getattr(args, "backend", "simulator") == "flower":
        raise FedclusterError(
            "--sweep of fields other than algorithm parameters and --trials "
            "work with the simulator backend only"
        )
    base = resolve_config(
        args.config, args.preset, args.sets, _overrides(args), algorithms=_algorithm_names(args)
    )
    slug = run_slug(args.sets, getattr(args, "algorithms", None), args.sweeps)
    out = check_path(args.out or f"runs/{base.name}-{slug}-{datetime.now():%Y%m%d-%H%M%S}", "--out")
    callbacks = _callbacks(args)

    def run_one(config: ExperimentConfig, where: Path) -> None:
        print(f"fedcluster: {config.name} -> {where}", file=sys.stderr)
        with _stops_are_resumable(where):
            Experiment(config, callbacks=callbacks).run(where, progress=not args.quiet)

    result = run_sweep(
        base.model_dump(mode="json"),
        axes_of(args.sweeps),
        out,
        trials=args.trials,
        seed=args.sweep_seed,
        run=run_one,
        report=not args.no_report,
    )
    print()
    print(result.table(), end="")
    print(f"\nsweep: {out / 'summary.json'}")
    if result.report is not None:
        print(f"report: {result.report}")
    return 0


def _serves() -> bool:
    """Under torchrun, serve as a distributed worker on every rank but 0 (the driver);
    True when this process was one (it has served and the run is over)."""
    from fedcluster.experiment.distributed import serve, torchrun_rank

    if torchrun_rank() in (None, 0):
        return False
    serve()
    return True


class Interrupted(Exception):
    """Ctrl-C (SIGINT) during a run: what to do next, in one line (exit status 130)."""


@contextmanager
def _stops_are_resumable(out: Path) -> Iterator[None]:
    """A full disk (``ENOSPC``) or Ctrl-C ends the run with one line: the directory
    keeps its last complete checkpoints (files are replaced atomically), so it can be
    resumed."""
    try:
        yield
    except KeyboardInterrupt:
        has_checkpoint = any((out / "checkpoints").glob("*.pt"))
        raise Interrupted(
            f"interrupted; `fedcluster resume {out}` continues from its last checkpoint"
            if has_checkpoint
            else "interrupted before the first checkpoint; run it again"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        raise FedclusterError(
            f"no space left on the device{where}; free some space, then "
            f"`fedcluster resume {out}` (or run again if it had no checkpoint yet)"
        ) from None


def _callbacks(args: argparse.Namespace) -> list:
    if not args.tensorboard:
        return []
    from fedcluster.experiment.loggers import TensorBoardLogger

    where = check_path(args.tensorboard, "--tensorboard")
    if where.exists() and not where.is_dir():
        raise FedclusterError(f"--tensorboard {where} is an existing file, not a directory")

    return [TensorBoardLogger(args.tensorboard)]


def _report(args: argparse.Namespace, out: Path) -> None:
    """Write the run's report and print its path as the last line (unless --no-report)."""
    if args.no_report:
        return
    from fedcluster.reporting import write_report

    print(f"report: {write_report([out])}")


def _run_flower(config: ExperimentConfig, out: Path, progress: bool) -> None:
    try:
        from fedcluster.flower.server import run_simulation
    except ImportError as exc:
        raise FedclusterError(
            f"--backend flower needs Flower: pip install 'fedcluster[flower]' ({exc})"
        ) from None
    logging.getLogger("flwr").propagate = False  # Flower prints its own log; no copy at DEBUG
    run_simulation(config, out, progress=progress)


def _resume(args: argparse.Namespace) -> int:
    from fedcluster.experiment.runner import resume

    if not (Path(args.dir) / "config.yaml").exists():
        raise FedclusterError(f"{args.dir} is not a run directory (no config.yaml)")
    if _execution(args).get("backend") == "distributed" and _serves():
        return 0
    callbacks = _callbacks(args)
    with _stops_are_resumable(Path(args.dir)):
        resume(
            args.dir,
            progress=not args.quiet,
            callbacks=callbacks,
            trust=args.trust,
            execution=_execution(args),
        )
    from fedcluster.experiment.summary import print_summary

    print_summary(Path(args.dir))
    _report(args, Path(args.dir))
    return 0


def _assign(args: argparse.Namespace) -> int:
    import json

    from fedcluster.experiment.cluster_choice import FinishedRun, format_assignments

    seeds = None if args.seed is None else [args.seed]
    run = FinishedRun.load(args.run, _algorithm_names(args), seeds, trust=args.trust)
    assignments = run.assign(run.read(args.data), record=args.record)
    if args.json:
        print(json.dumps([a.to_dict() for a in assignments], indent=1))
    else:
        print(format_assignments(assignments))
    if args.record:
        print(f"recorded: {Path(args.run) / 'assign.csv'}", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace) -> int:
    from fedcluster.experiment.catalog import format_sections

    print(format_sections(args.section))
    return 0


def _show(args: argparse.Namespace) -> int:
    from fedcluster.config.schema import dump_config, resolve_config

    print(dump_config(resolve_config(None, args.preset, args.sets)), end="")
    return 0


def _report_command(args: argparse.Namespace) -> int:
    from fedcluster.reporting import write_report
    from fedcluster.sweeps import is_sweep

    if len(args.runs) == 1 and args.out is None and is_sweep(args.runs[0]):
        from fedcluster.reporting.sweep import write_sweep_report

        print(f"report: {write_sweep_report(args.runs[0])}")
        return 0
    print(f"report: {write_report(args.runs, args.out)}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """One line per pinned dataset file; exit 1 when one differs, is missing from a dataset
    that is there, cannot be read, or an unpinned uncompressed twin would be read."""
    from fedcluster.data.integrity import FAILING, verify_data_dir
    from fedcluster.data.sources import resolve_data_dir

    root = resolve_data_dir(args.data_dir)
    if not root.is_dir():
        raise FedclusterError(f"--data-dir {root} is not a directory")
    checks = verify_data_dir(root)
    for c in checks:
        details = {"differs": f"  (sha256 {c.sha256})", "unreadable": f"  ({c.reason})"}
        detail = details.get(c.status, "")
        print(f"{c.status:10} {root / c.path}{detail}")
    bad = [c for c in checks if c.status in FAILING]
    present = sum(c.status in ("ok", "differs") for c in checks)
    print(f"{present} known files present, {len(bad)} not as pinned", file=sys.stderr)
    return 1 if bad else 0


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM ends a command as Ctrl-C does: one line, and a run stays resumable."""
    raise KeyboardInterrupt


def _benchmark(args: argparse.Namespace) -> int:
    """``fedcluster benchmark SUITE``: run or resume the suite, print the leaderboard."""
    from fedcluster.benchmark import load_suite, run_benchmark

    suite = load_suite(args.suite)
    if args.methods:
        suite = suite.model_copy(update={"methods": [m.strip() for m in args.methods.split(",")]})
    out = Path(args.out or f"runs/{suite.name}")
    result = run_benchmark(suite, out, jobs=args.jobs, progress=not args.quiet)
    print(result.table())
    print(f"report: {result.report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``fedcluster`` command; its exit status. Ctrl-C or SIGTERM at any moment of
    it (also while torch is imported and the config read) ends with one line, status 130."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if on_main_thread else None
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before or after the run itself (_stops_are_resumable)
        print("fedcluster: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    prefer_passive_wait()  # before anything imports torch (fedcluster.openmp)
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    if not argv:
        argv = ["run"]
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "compare":
            return _run(args)
        if args.command == "resume":
            return _resume(args)
        if args.command == "report":
            return _report_command(args)
        if args.command == "assign":
            return _assign(args)
        if args.command == "benchmark":
            return _benchmark(args)
        if args.command == "list":
            return _list(args)
        if args.command == "show":
            return _show(args)
        if args.command == "flower" and args.flower_command:
            from fedcluster.flower.commands import flower_command

            return flower_command(args, _overrides(args) if hasattr(args, "rounds") else {})
        if args.command == "verify":
            return _verify(args)
        parser.print_help()
        return 2
    except FedclusterError as exc:
        if debug:
            traceback.print_exception(exc)
        print(f"fedcluster: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"fedcluster: {exc}", file=sys.stderr)
        return 130
    except OSError as exc:  # an unwritable --out, a read-only or /proc path, a name too long
        where = f": {exc.filename}" if exc.filename else ""
        print(f"fedcluster: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
