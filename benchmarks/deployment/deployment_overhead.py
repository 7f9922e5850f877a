"""Per-message overhead of a real Flower deployment (``fedcluster flower local``).

Runs one config (default: the quickstart with 4 clients, FedAvg, 2 rounds;
``--full``: the preset as it is) in the simulator and through ``fedcluster
flower local`` with ``--nodes`` nodes (default: one per client; a node sends
one message per request for all its clients), once per ClientApp isolation:

- ``subprocess``: Flower 1.42's default, a fresh ``flwr-clientapp`` per message;
- ``process``: one long-lived ClientApp worker per node (``fedcluster.flower.worker``).

Per isolation it reports the launcher's wall time (start-up, export and
teardown included), the jobs' round time (the metrics' ``client_seconds`` +
``eval_seconds``: what the ServerApp waited for replies), the requests each
node answered (``Receiving:`` lines of its log), seconds per request, and, in
``process`` mode, the ClientApp's own time per task (the worker's log: pull,
compute, push), so that a request's time splits into the ClientApp's work and
Flower's transport and polling. The simulator's wall time for the same config
gives the deployment's overhead ratio (goal: ≤ 5×).

    python -m benchmarks.deployment.deployment_overhead --out runs/deploy-bench
    python -m benchmarks.deployment.deployment_overhead --preset quickstart \\
        --set data.partition.base_options.n_clients=4 --rounds 3 --isolation process
    # goal: the whole quickstart on 4 nodes, within 5x the simulator
    python -m benchmarks.deployment.deployment_overhead --full --nodes 4 --isolation process

Measure on a quiet machine; on a loaded one the numbers show only that it runs.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import default_data_dir
from fedcluster.config.schema import resolve_config
from fedcluster.experiment.runner import Experiment
from fedcluster.reproduce import save_json

TASK = re.compile(r"task \d+ \(([\w.]+)\): ([\d.]+) s")


def _job_seconds(run: Path) -> float:
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return sum(float(r["client_seconds"]) + float(r["eval_seconds"] or 0) for r in rows)


def _requests_per_node(folder: Path) -> list[int]:
    logs = [p for p in sorted(folder.glob("node-[0-9]*.log")) if "worker" not in p.name]
    return [p.read_text(errors="replace").count("Receiving:") for p in logs]


def _worker_tasks(folder: Path) -> dict[str, list[float]]:
    tasks: dict[str, list[float]] = {}
    for log in folder.glob("node-*.worker.log"):
        for kind, seconds in TASK.findall(log.read_text(errors="replace")):
            tasks.setdefault(kind, []).append(float(seconds))
    return tasks


def main(argv: list[str] | None = None) -> int:
    from fedcluster.flower.launcher import run_local

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="quickstart")
    p.add_argument("--config")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=None,
        help="config override (default: 4 clients, fedavg)",
    )
    p.add_argument("--rounds", type=int, help="default: 2 (--full: the config's)")
    p.add_argument("--nodes", type=int, help="SuperNodes (default: one per client)")
    p.add_argument(
        "--full", action="store_true", help="the preset or config as it is (no default --set)"
    )
    p.add_argument("--isolation", default="subprocess,process")
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--out", default="runs/deployment-overhead")
    args = p.parse_args(argv)
    small = ["data.partition.base_options.n_clients=4", "algorithms=[{name: fedavg}]"]
    sets = args.sets or ([] if args.full else small)
    rounds = args.rounds if args.rounds is not None else (None if args.full else 2)
    override: dict = {"data": {"data_dir": args.data_dir}, "seeds": [0]}
    if rounds is not None:
        override["rounds"] = rounds
    config = resolve_config(args.config, args.preset, sets, override)
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    t = time.perf_counter()
    Experiment(config).run(out / "simulator", progress=False)
    sim = time.perf_counter() - t
    result: dict = {"config": config.name, "rounds": config.rounds, "simulator_wall_s": sim}
    for isolation in args.isolation.split(","):
        run = out / isolation
        t = time.perf_counter()
        nodes = args.nodes or Experiment(config).federation(0).n_clients
        run_local(config, run, nodes, isolation=isolation, emit=lambda s: None)
        wall = time.perf_counter() - t
        folder = run / "deployment"
        requests = _requests_per_node(folder)
        job = _job_seconds(run)
        tasks = _worker_tasks(folder)
        entry = {
            "nodes": nodes,
            "wall_s": wall,
            "ratio_to_simulator": wall / sim,
            "round_time_s": job,
            "requests_per_node": requests,
            "seconds_per_request": job / max(1, max(requests) - 1),  # setup not in round time
        }
        if tasks:
            entry["clientapp_task_median_s"] = {
                k: statistics.median(v) for k, v in sorted(tasks.items())
            }
        result[isolation] = entry
        print(f"{isolation}: {entry}", file=sys.stderr)
    print(f"simulator: {sim:.2f} s", file=sys.stderr)
    save_json(out / "result.json", result)
    print(out / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
