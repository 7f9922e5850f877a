"""Wall time of the main job (``fedcluster run``, the quickstart preset), report included.

Budget: at most 90 s on 2 cores after install. Runs the README's
first command as a subprocess with ``taskset`` on two cores where available,
and prints the wall time with the load average before and after, so a number
from a busy machine is recognisable as such::

    python -m benchmarks.main_job                 # the real measurement
    python -m benchmarks.main_job --rounds 2      # a smoke run of the script
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="fewer rounds (smoke test)")
    p.add_argument("--cores", default="0,1", help="CPUs for taskset (default 0,1)")
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="fedcluster-main-job-")
    cmd = [sys.executable, "-m", "fedcluster.cli", "run", "--quiet", "--out", f"{out}/run"]
    if args.rounds is not None:
        cmd += ["--rounds", str(args.rounds)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", args.cores, *cmd]
    before = os.getloadavg()
    t0 = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    after = os.getloadavg()
    print(result.stdout.strip().splitlines()[-1])
    print(
        f"wall {wall:.1f} s on cores {args.cores} ({os.cpu_count()} CPUs); load average "
        f"(1 min) before {before[0]:.2f}, after {after[0]:.2f}"
    )
    shutil.rmtree(out)


if __name__ == "__main__":
    main()
