#!/bin/bash
# CIFAR-10 as the papers train it, on one GPU (docs/reproduction.md
# "CIFAR-10"). Five jobs run side by side (each one small-kernel bound, so a GPU runs
# them together in about the time of the longest), each under a deadline:
#   sanity      benchmarks/reproduction/cifar_sanity.py: LeNet with CFLGT's settings, then IFCA's CNN
#               with IFCA's, on the pooled training images (test accuracy per epoch)
#   s2-cflgt, s2-ifca, s2-fedavg
#               preset cflgt-s2-cifar10 (CFLGT Table I, Cifar scenario 2: 65.72 / 60.20 /
#               50.51 last-20-round mean), $ROUNDS_S2 rounds (25 of pre-training)
#   rot-ifca    preset ifca-rotated-cifar10 (IFCA Table 1: 81.51%), $ROUNDS_ROT rounds
# then a table per setting (src/fedcluster/reproduce.py summarize: last-20 / final accuracy,
# clusters, purity, ARI). Everything is written under $OUT: sanity-lenet-e<epochs>.json,
# sanity-ifca-cnn-e<epochs>.json (one row per epoch), runs/<job>-r<rounds>/ (run
# directories: metrics.csv, clusters.csv, checkpoints/), logs/<job>.log,
# cflgt-s2/summarize.json, rotated/summarize.json and status.txt.
#
# Run from the repository root with the FULL CIFAR-10 (the 60 MiB cifar10-images.zip of
# shared/data, not a subset) in .gpudata/cifar10/:
#   mkdir -p .gpudata/cifar10 && cp "$FEDCLUSTER_DATA"/cifar10/cifar10-images.zip .gpudata/cifar10/
#   run(command="bash benchmarks/gpu/cifar_runs.sh", carry=[".gpudata/cifar10"], timeout_s=560)
# Resuming: a job whose run directory has summary.json is skipped, one with checkpoints
# resumes to its own round count (`fedcluster resume`), a sanity JSON with "complete": true
# is kept. $OUT is empty on every call, so copy what a cut-short call brought back into
# .gpuresume/ and carry it too (carry=[".gpudata/cifar10", ".gpuresume"]); it is copied
# into $OUT first. Carried paths total at most 64 MiB and the data take 60: carry back the
# small run directories (s2-*, sanity JSONs) and leave out rot-ifca's (its checkpoints hold
# two 1.8M-parameter models, ~14 MB; that job then starts again).
# Settings by environment: BUDGET (seconds for the jobs, default 400), ROUNDS_S2 (65),
# ROUNDS_ROT (60), LENET_EPOCHS (20), IFCA_CNN_EPOCHS (30), DEVICE (cuda), DATA (.gpudata),
# RESUME (.gpuresume), SETS_S2 / SETS_ROT (extra --set arguments, split at spaces) and
# SANITY_SUBSET (training images of the sanity rows, default 0: all), e.g. for a CPU smoke
# run: DEVICE=cpu ROUNDS_S2=2 SETS_S2="--set participation.fraction=0.05" ...
export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
BUDGET=${BUDGET:-400} ROUNDS_S2=${ROUNDS_S2:-65} ROUNDS_ROT=${ROUNDS_ROT:-60}
LENET_EPOCHS=${LENET_EPOCHS:-20} IFCA_CNN_EPOCHS=${IFCA_CNN_EPOCHS:-30}
DEVICE=${DEVICE:-cuda} DATA=${DATA:-.gpudata} SANITY_SUBSET=${SANITY_SUBSET:-0}
OUT=${OUT:?set OUT to the results folder}
mkdir -p "$OUT/runs" "$OUT/logs"
RESUME=${RESUME:-.gpuresume}
[ -d "$RESUME" ] && cp -rn "$RESUME"/. "$OUT/"
T0=$SECONDS
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  lscpu | grep "Model name"
} | tee "$OUT/status.txt"

# The full CIFAR-10, decoded once (the JPEG zip is cached as .npz for the jobs after).
python3 - "$DATA" <<'EOF' || exit 1
import sys
from fedcluster.data.sources import load_dataset
ds = load_dataset("cifar10", sys.argv[1], normalize="none")
n = (len(ds.train.y), 0 if ds.test is None else len(ds.test.y))
if n != (50000, 10000):
    sys.exit(f"{sys.argv[1]}/cifar10 holds {n[0]} training and {n[1]} test images; "
             "these runs need the full CIFAR-10 (50000 and 10000)")
print("CIFAR-10 decoded:", n)
EOF
echo "data ready at $((SECONDS - T0)) s" | tee -a "$OUT/status.txt"
DEADLINE=$((T0 + BUDGET))

# fedcluster job: NAME PRESET ROUNDS SETS... (run, or resume its checkpoints, or skip)
job() {
  local name=$1-r$3 preset=$2 rounds=$3 dir="$OUT/runs/$1-r$3"
  shift 3
  local left=$((DEADLINE - SECONDS))
  if [ -f "$dir/summary.json" ]; then echo "$name: complete, skipped"; return; fi
  if [ "$left" -lt 30 ]; then echo "$name: no time left"; return; fi
  if [ -d "$dir/checkpoints" ]; then
    timeout -s INT "$left" python3 -m fedcluster.cli resume "$dir" --quiet --no-report
  else
    rm -rf "$dir"
    timeout -s INT "$left" python3 -m fedcluster.cli run --preset "$preset" --rounds "$rounds" \
      --data-dir "$DATA" --set device="$DEVICE" --set checkpoint_every=5 "$@" \
      --out "$dir" --quiet --no-report
  fi
  echo "$name: exit $? at $((SECONDS - T0)) s"
}

# sanity row: NAME PRESET EPOCHS (skipped when its JSON is complete)
sanity() {
  local file="$OUT/sanity-$1-e$3.json" left=$((DEADLINE - SECONDS))
  if grep -q '"complete": true' "$file" 2>/dev/null; then echo "sanity $1: complete"; return; fi
  if [ "$left" -lt 30 ]; then echo "sanity $1: no time left"; return; fi
  timeout -s INT "$left" python3 -m benchmarks.reproduction.cifar_sanity --preset "$2" --epochs "$3" \
    --device "$DEVICE" --data-dir "$DATA" --train-subset "$SANITY_SUBSET" --out "$file"
  echo "sanity $1: exit $? at $((SECONDS - T0)) s"
}

S2=(--set eval_every=1 $SETS_S2)
ROT=(--set eval_every=5 $SETS_ROT)
(sanity lenet cflgt-s2-cifar10 "$LENET_EPOCHS"; sanity ifca-cnn ifca-rotated-cifar10 \
  "$IFCA_CNN_EPOCHS") > "$OUT/logs/sanity.log" 2>&1 &
job s2-cflgt cflgt-s2-cifar10 "$ROUNDS_S2" --algorithms cflgt "${S2[@]}" \
  > "$OUT/logs/s2-cflgt.log" 2>&1 &
job s2-ifca cflgt-s2-cifar10 "$ROUNDS_S2" --algorithms ifca "${S2[@]}" \
  > "$OUT/logs/s2-ifca.log" 2>&1 &
job s2-fedavg cflgt-s2-cifar10 "$ROUNDS_S2" --algorithms fedavg "${S2[@]}" \
  > "$OUT/logs/s2-fedavg.log" 2>&1 &
job rot-ifca ifca-rotated-cifar10 "$ROUNDS_ROT" --algorithms ifca "${ROT[@]}" \
  > "$OUT/logs/rot-ifca.log" 2>&1 &
wait
tail -n 3 "$OUT"/logs/*.log | tee -a "$OUT/status.txt"

# Tables from whatever rounds each job completed (metrics.csv is written round by round).
summary() {
  local out=$1 last=$2 runs=()
  shift 2
  for r in "$@"; do [ -s "$OUT/runs/$r/metrics.csv" ] && runs+=("$OUT/runs/$r"); done
  [ ${#runs[@]} -gt 0 ] && python3 -m fedcluster.reproduce summarize --runs "${runs[@]}" \
    --last "$last" --out "$OUT/$out" 2>&1 | tail -n 12
}
summary cflgt-s2 20 s2-{cflgt,ifca,fedavg}-r"$ROUNDS_S2" | tee -a "$OUT/status.txt"
summary rotated 20 rot-ifca-r"$ROUNDS_ROT" | tee -a "$OUT/status.txt"
python3 - "$OUT" <<'EOF' | tee -a "$OUT/status.txt"
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("sanity-*.json")):
    d = json.loads(f.read_text())
    last = d["epochs"][-1] if d["epochs"] else {}
    print(f"{f.stem}: {d['settings']['model']}, {len(d['epochs'])} epochs, "
          f"test accuracy {last.get('test_accuracy')}, complete {d['complete']}")
EOF
echo "== done at $((SECONDS - T0)) s" | tee -a "$OUT/status.txt"
