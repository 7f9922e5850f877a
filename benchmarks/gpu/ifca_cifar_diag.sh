#!/bin/bash
# Why IFCA's rotated CIFAR-10 ends in one cluster (docs/reproduction.md
# "IFCA's rotated CIFAR-10: why one cluster"), on one GPU. Jobs run side by side, each the
# preset ifca-rotated-cifar10 (IFCA only) through benchmarks/reproduction/ifca_cifar_diag.py, which logs
# every client's loss under both cluster models and its choice (choices.csv, groups.csv;
# every training client probed every $PROBE rounds), under one deadline:
#   fixed      the preset as it is now: the good initializer judges the initial models
#              by the loss the choice uses (all of a client's training data)
#   old-init   the behaviour before the fix: the initializer judged them on one
#              mini-batch of 50 images (--init-batches one)
#   shared     as fixed, with IFCA's weight sharing (shared_layers: all_but_last; the
#              paper's Sec. 5, not the reference's cifar/ code): the K models share all
#              layers but the last, so no cluster's features starve
# Written under $OUT/ifca-cifar/: <job>/choices.csv, <job>/groups.csv, <job>/run/
# (metrics.csv, clusters.csv, config.yaml; checkpoints removed at the end),
# <job>/summarize.json (final / last-20 accuracy, clusters, purity, ARI), logs/<job>.log
# and status.txt; then all of it (no checkpoints) in ONE file $OUT/ifca-cifar.tgz.
#
# Integrator's command (repository root, full CIFAR-10 as an image tree in /tmp/gd/cifar10):
#   OUT=$OUT DATA=/tmp/gd bash benchmarks/gpu/ifca_cifar_diag.sh
# It stops by itself after about BUDGET + 30 s (the jobs are stopped BUDGET = 420 s after
# the start, data decoding included; then the tables and the tar): at most 7.5 minutes.
# At most 4 CPU cores (taskset -c 0-3, one thread per job).
# Settings by environment: BUDGET (seconds from the start until the jobs stop, default
# 420), ROUNDS (600: the jobs stop at the deadline), PROBE (5), DEVICE (cuda), DATA (/tmp/gd), JOBS ("fixed
# old-init shared"), SMOKE=1 (a CPU smoke test at tiny scale: DEVICE=cpu, 10 clients of
# 50 images, tests on 100, 1 epoch, 2 rounds, DATA=$FEDCLUSTER_DATA).
set -u
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export MKL_NUM_THREADS=1 PYTHONWARNINGS=ignore
OUT=${OUT:?set OUT to the results folder}
BUDGET=${BUDGET:-420} ROUNDS=${ROUNDS:-600} PROBE=${PROBE:-5} DEVICE=${DEVICE:-cuda}
DATA=${DATA:-/tmp/gd} JOBS=${JOBS:-fixed old-init shared} SMOKE=${SMOKE:-0}
SETS=(--set device="$DEVICE" --set eval_every=5 --set checkpoint_every=5)
if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu ROUNDS=2 BUDGET=${SMOKE_BUDGET:-900} DATA=${FEDCLUSTER_DATA:-/work/shared/data}
  SETS=(--set device=cpu --set eval_every=1 --set checkpoint_every=1
    --set data.partition.base_options.n_clients=5 --set data.partition.test_clients=100
    --set data.partition.base_options.samples_per_client=50
    --set train.epochs=1 --set participation.fraction=0.4)
fi
PIN=(taskset -c 0-3)
"${PIN[@]}" true 2>/dev/null || PIN=()   # fewer than 4 cores (a smoke test): no pinning
R=$OUT/ifca-cifar
mkdir -p "$R/logs"
T0=$SECONDS
{
  date -u
  git log -1 --format='commit %H %s' 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "DEVICE=$DEVICE ROUNDS=$ROUNDS BUDGET=$BUDGET PROBE=$PROBE JOBS=$JOBS SMOKE=$SMOKE"
} 2>&1 | tee "$R/status.txt"

# Decode the images once (cached beside them as .npz) so that the jobs start together.
"${PIN[@]}" python3 - "$DATA" <<'EOF' 2>&1 | tee -a "$R/status.txt"
import sys
from fedcluster.data.sources import load_dataset
ds = load_dataset("cifar10", sys.argv[1], normalize="none")
print("CIFAR-10:", len(ds.train.y), "training and", 0 if ds.test is None else len(ds.test.y), "test images")
EOF
echo "data ready at $((SECONDS - T0)) s" | tee -a "$R/status.txt"
DEADLINE=$((T0 + BUDGET))

job() {
  local name=$1 left=$((DEADLINE - SECONDS))
  shift
  [ "$left" -lt 10 ] && left=10   # timeout 0 would mean no limit
  timeout -s INT -k 20 "$left" "${PIN[@]}" python3 -m benchmarks.reproduction.ifca_cifar_diag \
    --rounds "$ROUNDS" --probe-every "$PROBE" --data-dir "$DATA" "${SETS[@]}" "$@" \
    --out "$R/$name" > "$R/logs/$name.log" 2>&1
  echo "$name: exit $? at $((SECONDS - T0)) s" >> "$R/status.txt"
}
for name in $JOBS; do
  case $name in
    fixed) job fixed & ;;
    old-init) job old-init --init-batches one & ;;
    shared) job shared --set algorithms.ifca.shared_layers=all_but_last & ;;
    *) echo "unknown job $name" | tee -a "$R/status.txt" ;;
  esac
done
wait

# A table per job from whatever rounds it completed (metrics.csv is written as it goes),
# and its last probes: the share of each rotation group choosing model 0/1.
for name in $JOBS; do
  [ -s "$R/$name/run/metrics.csv" ] || continue
  echo "== $name" | tee -a "$R/status.txt"
  "${PIN[@]}" python3 -m fedcluster.reproduce summarize --runs "$R/$name/run" --last 20 \
    --out "$R/$name" 2>&1 | tail -n 3 | tee -a "$R/status.txt"
  grep -h "^round" "$R/logs/$name.log" | tail -n 8 | tee -a "$R/status.txt"
done
echo "== done at $((SECONDS - T0)) s" | tee -a "$R/status.txt"
find "$R" -type d -name checkpoints -prune -exec rm -rf {} +
tar czf "$OUT/ifca-cifar.tgz" -C "$OUT" ifca-cifar && rm -rf "$R"
ls -l "$OUT"
