"""A node lost (and restarted) during ``fedcluster flower local``, by hand (docs/flower.md).

Runs ``fedcluster flower local --preset quickstart --rounds 3 --nodes 4 --out
RUN`` with the default deployment settings, SIGKILLs node 1 (its SuperNode
and ClientApp worker, pids from ``RUN/deployment/nodes.json``) after the
first job's round 1 and, with ``--restart``, starts it again after round 2
from its command line in ``nodes.json`` (a new SuperNode: without ``--auth``
it registers under a new node id). Prints when it killed and restarted the
node and the launcher's exit code; the run directory holds the rest
(``events.csv``: ``failed`` / ``rejoined``; ``clusters.csv``; ``status.json``).

    python -m benchmarks.deployment.flower_lost_node runs/lost-node
    python -m benchmarks.deployment.flower_lost_node runs/lost-node-back --restart
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _first_job_round(run: Path, rnd: int, cli: subprocess.Popen) -> str | None:
    """Wait until the first job's round ``rnd`` is in the metrics; the job's label."""
    while cli.poll() is None:
        try:
            with open(run / "metrics.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            first = rows[0]["algorithm"] if rows else None
            if rows and rows[-1]["algorithm"] == first and int(rows[-1]["round"]) >= rnd:
                return first
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the run directory (must not exist)")
    p.add_argument("--restart", action="store_true", help="restart the node after round 2")
    p.add_argument("--node", type=int, default=1, help="the node to kill")
    args = p.parse_args(argv)
    run = Path(args.out).absolute()
    start = time.monotonic()
    command = [sys.executable, "-m", "fedcluster.cli", "flower", "local"]
    command += ["--preset", "quickstart", "--rounds", "3", "--nodes", "4", "--out", str(run)]
    cli = subprocess.Popen(command)
    job = _first_job_round(run, 1, cli)
    if job is None:
        return cli.wait()
    info = json.loads((run / "deployment/nodes.json").read_text())["nodes"][args.node]
    for pid in (info["pid"], info["worker_pid"]):
        os.kill(pid, signal.SIGKILL)
    print(
        f"killed node {args.node} (clients {info['clients']}) after {job} round 1 "
        f"at {time.monotonic() - start:.0f} s",
        flush=True,
    )
    restarted: list[subprocess.Popen] = []
    if args.restart and _first_job_round(run, 2, cli) is not None:
        env = {**os.environ, **info["env"]}
        log = open(Path(info["log"]).with_suffix(".restart.log"), "ab")  # noqa: SIM115
        node = subprocess.Popen(info["command"], stdout=log, stderr=log, env=env)
        worker = [sys.executable, "-m", "fedcluster.flower.worker", "--runtime-api-address"]
        worker += [f"127.0.0.1:{info['runtime_port']}", "--insecure", "--parent-pid", str(node.pid)]
        restarted = [node, subprocess.Popen(worker, stdout=log, stderr=log, env=env)]
        print(
            f"restarted node {args.node} after {job} round 2 at {time.monotonic() - start:.0f} s",
            flush=True,
        )
    code = cli.wait()
    for proc in restarted:
        proc.kill()
        proc.wait()
    print(f"exit {code} after {time.monotonic() - start:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
