"""The ``fedcluster flower export | app | status | local`` commands (docs/flower.md).

They take the config flags of ``fedcluster run`` (config, ``--preset``,
``--set``, ``--rounds``, ``--seed``, ``--data-dir``) and hand the resolved
experiment to :mod:`~fedcluster.flower.export`, :mod:`~fedcluster.flower.app`
and :mod:`~fedcluster.flower.launcher`. ``status RUN`` reads the final status
the deployed ServerApp wrote (:data:`fedcluster.flower.app.STATUS`).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from fedcluster.errors import FedclusterError


def flower_command(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """Run ``fedcluster flower <args.flower_command>``; the exit code."""
    from fedcluster.config.schema import resolve_config

    if args.flower_command == "status":
        return run_status(Path(args.run))
    config = resolve_config(args.config, args.preset, args.sets, overrides)
    if args.flower_command == "export":
        return _export(config, args)
    try:
        import flwr  # noqa: F401
    except ImportError as exc:
        raise FedclusterError(f"needs Flower: pip install 'fedcluster[flower]' ({exc})") from None
    if args.flower_command == "app":
        from fedcluster.flower.app import write_app

        folder = write_app(args.dir, config, out=args.out, manifest=args.manifest)
        print(f"fedcluster: Flower App written to {folder}; run it with `flwr run {folder} <conn>`")
        return 0
    if args.flower_command == "local":
        from fedcluster.experiment.summary import print_summary
        from fedcluster.flower.launcher import run_local

        out = Path(args.out or f"runs/{config.name}-local-{datetime.now():%Y%m%d-%H%M%S}")
        run_local(
            config,
            out,
            args.nodes,
            tls=args.tls,
            auth=args.auth,
            timeout=args.timeout,
            isolation=args.isolation,
        )
        print_summary(out)
        return 0
    raise FedclusterError(f"unknown flower command {args.flower_command!r}")


def run_status(run: Path) -> int:
    """``fedcluster flower status RUN``: print the outcome; 0 completed, 1 failed."""
    from fedcluster.flower.app import read_status

    status = read_status(run)
    if status["status"] == "completed":
        print(f"{run}: completed")
        return 0
    print(f"{run}: {status['status']}: {status['reason']}")
    return 1


def _export(config, args: argparse.Namespace) -> int:
    from fedcluster.flower.export import export_federation, export_for_nodes

    if not args.out:
        raise FedclusterError("fedcluster flower export needs --out DIR")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise FedclusterError(f"{out} is not empty; choose another --out")
    manifest = export_federation(config, out, args.seed)
    print(
        f"fedcluster: {len(manifest.clients)} clients of {config.name} (seed {manifest.seed}) "
        f"-> {out}",
        file=sys.stderr,
    )
    if args.nodes:
        for folder, clients in export_for_nodes(out, args.nodes):
            print(f"  {folder}: clients {clients}", file=sys.stderr)
    return 0
