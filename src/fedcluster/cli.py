"""Command-line interface: ``fedcluster run | compare | resume | list | verify``."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from fedcluster import __version__
from fedcluster.errors import FedclusterError

if TYPE_CHECKING:
    from fedcluster.config import ExperimentConfig


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="experiment YAML (default: the quickstart preset)")
    p.add_argument("--preset", help="start from a named preset (see `fedcluster list`)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.lr=0.1 (repeatable)",
    )
    p.add_argument("--rounds", type=int, help="communication rounds")
    p.add_argument("--data-dir", help="dataset root (default $FEDCLUSTER_DATA or the user cache)")
    p.add_argument("--out", help="run directory (default runs/<name>-<timestamp>)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedcluster",
        description="Clustered federated learning: JGL, CFLGT, DCFL, FedGroup and baselines.",
    )
    parser.add_argument("--version", action="version", version=f"fedcluster {__version__}")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="run an experiment and write its run directory")
    _common(run)
    run.add_argument("--seed", type=int, help="random seed")
    run.add_argument(
        "--backend",
        choices=("simulator", "flower"),
        default="simulator",
        help="run the client computations in the batched simulator (default) or on "
        "Flower's simulation engine, one SuperNode per client (needs `pip install "
        "'fedcluster[flower]'`)",
    )

    compare = sub.add_parser("compare", help="run several algorithms on the same federation")
    _common(compare)
    compare.add_argument(
        "--algorithms", required=True, help="comma-separated algorithm names, e.g. jgl,ifca,fedavg"
    )
    compare.add_argument("--seeds", type=int, default=1, help="number of seeds (0..N-1)")

    res = sub.add_parser("resume", help="continue a killed run from its checkpoints")
    res.add_argument("dir", help="run directory")
    res.add_argument("--quiet", action="store_true")

    sub.add_parser("list", help="show algorithms, datasets, partitions, models and presets")
    ver = sub.add_parser("verify", help="check local dataset files against pinned SHA-256 sums")
    ver.add_argument("--data-dir", help="dataset root (default $FEDCLUSTER_DATA or the user cache)")
    return parser


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
    if getattr(args, "algorithms", None):
        over["algorithms"] = [{"name": n.strip()} for n in args.algorithms.split(",") if n.strip()]
    return over


def _run(args: argparse.Namespace) -> int:
    from fedcluster.config import resolve_config
    from fedcluster.runner import Experiment

    config = resolve_config(args.config, args.preset, args.sets, _overrides(args))
    out = Path(args.out or f"runs/{config.name}-{datetime.now():%Y%m%d-%H%M%S}")
    if out.exists() and not out.is_dir():
        raise FedclusterError(f"--out {out} is an existing file, not a directory")
    if out.exists() and any(out.iterdir()):
        raise FedclusterError(f"run directory {out} is not empty; choose another --out")
    print(f"fedcluster: {config.name} -> {out}", file=sys.stderr)
    fresh = not out.exists()
    try:
        if getattr(args, "backend", "simulator") == "flower":
            _run_flower(config, out, progress=not args.quiet)
        else:
            Experiment(config).run(out, progress=not args.quiet)
    except FedclusterError:
        _remove_if_unstarted(out, fresh)
        raise
    _print_summary(out)
    return 0


def _remove_if_unstarted(out: Path, fresh: bool) -> None:
    """Remove a run directory this command created when it failed before any checkpoint.

    Such a directory holds only the config and empty tables; leaving it would
    make the same command fail next time with "not empty". A directory with a
    checkpoint is a run that can be resumed and stays.
    """
    if fresh and out.is_dir() and not any((out / "checkpoints").glob("*")):
        shutil.rmtree(out)


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
    from fedcluster.runner import resume

    if not (Path(args.dir) / "config.yaml").exists():
        raise FedclusterError(f"{args.dir} is not a run directory (no config.yaml)")
    resume(args.dir, progress=not args.quiet)
    _print_summary(Path(args.dir))
    return 0


def _print_summary(out: Path) -> None:
    print()
    print((out / "summary.md").read_text(), end="")
    print(f"\nmetrics: {out / 'metrics.csv'}   clusters: {out / 'clusters.csv'}")


def _list() -> int:
    from fedcluster.algorithms import ALGORITHMS
    from fedcluster.config import list_presets
    from fedcluster.data.partitions import PARTITIONS
    from fedcluster.data.sources import list_datasets
    from fedcluster.models import MODELS

    sections = {
        "algorithms": sorted(ALGORITHMS),
        "datasets": list_datasets(),
        "partitions": sorted(PARTITIONS),
        "models": sorted(MODELS),
        "presets": list_presets(),
    }
    for title, names in sections.items():
        print(f"{title}: {', '.join(names)}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """One line per pinned dataset file; exit 1 when a present file differs from its pins."""
    from fedcluster.data.integrity import verify_data_dir
    from fedcluster.data.sources import resolve_data_dir

    root = resolve_data_dir(args.data_dir)
    if not root.is_dir():
        raise FedclusterError(f"--data-dir {root} is not a directory")
    checks = verify_data_dir(root)
    for c in checks:
        detail = f"  (sha256 {c.sha256})" if c.status == "differs" else ""
        print(f"{c.status:8} {root / c.path}{detail}")
    bad = [c for c in checks if c.status == "differs"]
    present = sum(c.status != "missing" for c in checks)
    print(f"{present} of {len(checks)} known files present, {len(bad)} differ", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    if not argv:
        argv = ["run"]
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "compare":
            return _run(args)
        if args.command == "resume":
            return _resume(args)
        if args.command == "list":
            return _list()
        if args.command == "verify":
            return _verify(args)
        parser.print_help()
        return 2
    except FedclusterError as exc:
        print(f"fedcluster: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
