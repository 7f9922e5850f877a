#!/bin/bash
# Scoreboard cells of docs/reproduction.md on many CPU cores, one
# single-thread process per core: every job is one algorithm x one seed of a cell of
# src/fedcluster/reproduce.py (`CELLS`), run as
#   OMP_NUM_THREADS=1 taskset -c <core> python -m fedcluster.reproduce <cell> --seeds 1 \
#     --first-seed <seed> --algorithms <label> --rounds <rounds> --out $OUT/runs/<job>
# Each core runs a worker that takes the next job of the list below (a queue: the list is in
# priority order, so the cells that matter most start first) until the deadline, BUDGET
# seconds after the start (default 450 = 7.5 min): every job runs under `timeout` to that
# deadline. Every round is evaluated and metrics.csv is written round by round, so a job cut
# by the deadline leaves its metrics up to the round it reached (checkpoints are not needed
# and are not kept). Then status.txt lists, per job, the rounds reached of those planned,
# and everything small (metrics.csv, clusters.csv, diagnostics/events, config.yaml, the
# cells' JSON tables, logs, status.txt) goes into ONE file, $OUT/scoreboard.tgz.
# The cells' score tables are in scoreboard.txt (and .json); from an unpacked tarball again:
#   python -m fedcluster.reproduce scoreboard --folder DIR --out DIR [--upto ROUND]
#
# Run from the repository root (the integrator's machine: cores 0-4 are taken):
#   DATA=/path/to/data OUT=/path/to/out bash benchmarks/gpu/scoreboard_cpu.sh
# Settings by environment: DATA (MNIST, Fashion-MNIST and EMNIST in the layout of
# shared/data; default $FEDCLUSTER_DATA), OUT (required), CORES (default 5-15; a list such as
# 0,2-3), BUDGET (default 450), PYTHON (default python3), TINY=1 (a smoke test: 2 rounds per
# job, cores 0-1, a 120 s budget, the CNN at a tenth of its clients' data), ONLY (a regular
# expression: only the jobs whose names match).
set -u
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
OUT=${OUT:?set OUT to the results folder}
DATA=${DATA:-${FEDCLUSTER_DATA:?set DATA to the data folder}}
PYTHON=${PYTHON:-python3}
TINY=${TINY:-0}
if [ "$TINY" = 1 ]; then
  CORES=${CORES:-0-1} BUDGET=${BUDGET:-120}
else
  CORES=${CORES:-5-15} BUDGET=${BUDGET:-450}
fi
ONLY=${ONLY:-.}
export FEDCLUSTER_DATA=$DATA
T0=$SECONDS
DEADLINE=$((T0 + BUDGET))
mkdir -p "$OUT/runs" "$OUT/logs"
STATUS=$OUT/status.txt

# The jobs, in priority order: NAME CELL SEED ALGORITHM ROUNDS [EXTRA --set ARGUMENTS].
# Expected minutes on one core (timed here: AMD EPYC core, one thread) in the comments.
jobs() {
  local s a
  # C8: CFLGT Table I, Fashion-MNIST scenario 2, 7 methods x 3 seeds, the paper's 125 rounds
  # (0.55-0.9 s a round: 1.3-1.9 min each; FL+HC's clustering round trains all 100 clients).
  for s in 0 1 2; do
    for a in cflgt ifca flhc fesem fedavg fedavg-ft fedprox; do
      echo "c8-$a-s$s cflgt-fmnist-s2 $s $a 125"
    done
  done
  # J4: JGL Fig. 4(d)-(f), the CNN at scale 0.1 (about 75 samples per client), 10 of the
  # cell's 15 rounds (JGL about 23 s a round: 4 min; IFCA 13 s: 2.3 min).
  echo "j4-jgl-s0 jgl-fig4-cnn 0 jgl-0.2 10"
  echo "j4-ifca-s0 jgl-fig4-cnn 0 ifca 10"
  # G12: FedGroup Table III, MNIST-MLP, 10 methods, seed 0, the paper's 300 rounds
  # (3-4.5 min each over 300 rounds on one EPYC core; 0.9-1.5 s a round early on).
  for a in fedgroup-edc fgp-edc fedprox fgp-madc fedgroup-madc ifca fg-rcc-edc fg-rac-edc \
    fesem fedavg; do
    echo "g12-$a-s0 fedgroup-mnist-mlp 0 $a 300"
  done
  # G24: FedGroup newcomers, 6 methods, seed 0, 200 of 300 rounds (the 900 newcomers have
  # all joined by round 181; about 2 min each).
  for a in fedgroup-edc fedgroup-madc fedgrouprox ifca fesem fedavg; do
    echo "g24-$a-s0 fedgroup-newcomers 0 $a 200"
  done
  # D8: DCFL Fig. 4 curves without DP, 60 rounds, DCFL / CFL / FedAvg (1 min per seed).
  for s in 0 1 2; do echo "d8-s$s dcfl-fig4 $s dcfl,cfl,fedavg 60"; done
  # C9-C15, C19: CFLGT Fashion-MNIST scenario 3 (and Table II's FL+HC(10), FL+HC(30)) at
  # the paper's 125 rounds, seeds 1 and 2 (seed 0 ran 75 rounds here); under 1 min each.
  for s in 1 2; do
    for a in cflgt ifca flhc fesem fedavg fedavg-ft fedprox; do
      echo "c9-$a-s$s cflgt-fmnist-s3 $s $a 125"
    done
    for a in flhc-10 flhc-30; do echo "c19-$a-s$s cflgt-table2-fmnist $s $a 125"; done
  done
  # G11: FGP-MADC on MNIST-MCLR, 300 rounds (about 3.5 min a seed; last, as the 2-core
  # machine runs it too).
  for s in 0 1 2; do echo "g11-s$s fedgroup-mnist-fgp-madc $s fgp-madc 300"; done
  echo "j4-jgl-s1 jgl-fig4-cnn 1 jgl-0.2 10"
  echo "j4-ifca-s1 jgl-fig4-cnn 1 ifca 10"
}

jobs | grep -E "^($ONLY)" > "$OUT/jobs.txt"
if [ "$TINY" = 1 ]; then  # 2 rounds each; the CNN on a tenth of its data
  awk '{$5 = 2; if ($2 == "jgl-fig4-cnn") $6 = "--set data.partition.scale=0.01"; print}' \
    "$OUT/jobs.txt" > "$OUT/jobs.tiny" && mv "$OUT/jobs.tiny" "$OUT/jobs.txt"
fi
N=$(wc -l < "$OUT/jobs.txt")
echo 0 > "$OUT/next"

# The cores of $CORES, one per line (ranges a-b expanded).
cores() {
  local part
  for part in ${CORES//,/ }; do
    if [[ $part == *-* ]]; then seq "${part%-*}" "${part#*-}"; else echo "$part"; fi
  done
}

{
  echo "scoreboard_cpu.sh: $N jobs, cores $CORES, budget $BUDGET s, data $DATA"
  lscpu | grep -E "Model name|^CPU\(s\)" | sed 's/  */ /g'
  $PYTHON -c "import torch, yaml, pydantic, fedcluster.experiment.runner; print('torch', torch.__version__)" \
    2>&1 | tail -1  # an ImportError here: every job will fail the same way
  uptime
} | tee "$STATUS"

# worker CORE: take jobs from the queue (the counter file under a lock) until none is left
# or the deadline is near (30 s: a job would not get past its set-up).
worker() {
  local core=$1 i line name cell seed algs rounds extra left
  while true; do
    i=$(flock "$OUT/next" sh -c 'i=$(cat "$1"); echo $((i + 1)) > "$1"; echo "$i"' _ "$OUT/next")
    [ "$i" -ge "$N" ] && return
    line=$(sed -n "$((i + 1))p" "$OUT/jobs.txt")
    read -r name cell seed algs rounds extra <<< "$line"
    left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 30 ]; then
      echo "$name: not started (no time left)" >> "$OUT/logs/queue.log"
      continue
    fi
    echo "$name: core $core, start at $((SECONDS - T0)) s" >> "$OUT/logs/queue.log"
    # shellcheck disable=SC2086  # extra holds --set arguments split at spaces
    timeout -s INT -k 5 "$left" taskset -c "$core" $PYTHON -m fedcluster.reproduce "$cell" \
      --seeds 1 --first-seed "$seed" --algorithms "$algs" --rounds "$rounds" \
      --data-dir "$DATA" --out "$OUT/runs/$name" $extra > "$OUT/logs/$name.log" 2>&1
    echo "$name: core $core, exit $? at $((SECONDS - T0)) s" >> "$OUT/logs/queue.log"
  done
}

for core in $(cores); do worker "$core" & done
wait
echo "jobs ended at $((SECONDS - T0)) s" | tee -a "$STATUS"

# Per job: rounds reached of those planned (per algorithm and seed), last accuracy, exit.
$PYTHON - "$OUT" <<'EOF' | tee -a "$STATUS"
import csv, re, sys
from pathlib import Path

out = Path(sys.argv[1])
queue = (out / "logs" / "queue.log").read_text() if (out / "logs" / "queue.log").exists() else ""
for line in (out / "jobs.txt").read_text().splitlines():
    name, cell, seed, algs, rounds = line.split()[:5]
    exits = re.findall(rf"^{re.escape(name)}: core \d+, exit (\d+) at (\d+) s", queue, re.M)
    state = f"exit {exits[0][0]} at {exits[0][1]} s" if exits else "not run"
    reached = {}
    for f in (out / "runs" / name).glob("*/metrics.csv"):
        for r in csv.DictReader(f.open()):
            reached[(r["algorithm"], r["seed"])] = (int(r["round"]), r["accuracy"])
    got = ", ".join(
        f"{a} s{s}: {rnd}/{rounds} rounds, acc {float(acc):.4f}" if acc else f"{a} s{s}: {rnd}"
        for (a, s), (rnd, acc) in sorted(reached.items())
    )
    print(f"{name:24s} {cell:28s} {state:18s} {got or '-'}")
EOF

# The cells' score tables (src/fedcluster/reproduce.py scoreboard), then one tarball of
# everything small (no checkpoints, no model artifacts).
timeout 60 $PYTHON -m fedcluster.reproduce scoreboard --folder "$OUT" --out "$OUT" \
  > "$OUT/scoreboard.txt" 2>&1
echo "scoreboard tables: exit $? ($(grep -c '^| ' "$OUT/scoreboard.txt") lines)" | tee -a "$STATUS"
tar -czf "$OUT/scoreboard.tgz" -C "$OUT" --exclude=checkpoints --exclude='*.pt' \
  --exclude='*.npz' --exclude=scoreboard.tgz jobs.txt status.txt scoreboard.txt \
  scoreboard.json logs runs
ls -l "$OUT/scoreboard.tgz"
echo "== done at $((SECONDS - T0)) s" | tee -a "$STATUS"
