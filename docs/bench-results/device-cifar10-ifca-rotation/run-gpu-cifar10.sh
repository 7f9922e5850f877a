#!/bin/bash
# Device call: GPU CIFAR-10 jobs on cores 0-6, the CPU scoreboard batch on 7-15.
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/gd/cifar10 /tmp/r /tmp/logs && tar -xJf .gpucifar/cifar10-tree.tar.xz -C /tmp/gd/cifar10
cp -r .gpudata/mnist .gpudata/fashion-mnist /tmp/gd/
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep "Model name"; nproc; python3 -c "import torch; print(torch.__version__)"; } > /tmp/r/machine.txt 2>&1
python3 -c "from fedcluster.data.sources import load_dataset; ds = load_dataset('cifar10', '/tmp/gd', normalize='none'); print(len(ds.train.y))" >> /tmp/r/machine.txt 2>&1
echo "setup $((SECONDS-T0)) s"; tail -1 /tmp/r/machine.txt
LIMIT=${LIMIT:-380}
J6ALGS="algorithms=[{name: jgl, label: jgl-0.2, params: {n_clusters: 4, lam: 0.2, init: random}}, {name: ifca, label: ifca, params: {n_clusters: 4, weighting: uniform, init: random}}]"
gpu() { # core name args...
  local core=$1 name=$2; shift 2
  OMP_NUM_THREADS=1 taskset -c $core timeout $LIMIT python3 -m fedcluster.cli run --data-dir /tmp/gd --set device=cuda --quiet --no-report --out /tmp/r/$name "$@" > /tmp/logs/$name.log 2>&1 &
}
gpu 0 s2-cflgt-r225 --preset cflgt-s2-cifar10 --rounds 225 --algorithms cflgt --set eval_every=1
gpu 1 s1-cflgt-r225 --preset cflgt-s2-cifar10 --rounds 225 --algorithms cflgt --set eval_every=1 --set data.partition.scenario=1
for s in 0 1 2; do
  gpu $((2+s)) j6-s$s --preset jgl-mnist --rounds 40 --seed $s --set data.dataset=cifar10 --set data.partition.table=jgl-cifar10 --set model.name=lenet --set 'model.options={}' --set data.partition.relabel=false --set eval_every=1 --set "$J6ALGS"
done
# IFCA rotated CIFAR-10 diagnosis (two jobs) on cores 5-6
sed 's/taskset -c 0-3/taskset -c 5-7/' benchmarks/gpu/ifca_cifar_diag.sh > /tmp/ifca_diag.sh
( mkdir -p /tmp/oi && OUT=/tmp/oi DATA=/tmp/gd BUDGET=${IFCA_BUDGET:-330} bash /tmp/ifca_diag.sh > /tmp/logs/ifca-diag.log 2>&1; cp /tmp/oi/ifca-cifar.tgz $OUT/ ) &
# CPU scoreboard batch on cores 7-15
( mkdir -p /tmp/sb && OUT=/tmp/sb DATA=/tmp/gd CORES=8-15 BUDGET=${SB_BUDGET:-370} bash benchmarks/gpu/scoreboard_cpu.sh > /tmp/logs/scoreboard.log 2>&1; cp /tmp/sb/scoreboard.tgz $OUT/ ) &
# watchdog: whatever exists at 550 s goes into one partial tarball
( sleep $((550 - (SECONDS - T0))); cd /tmp && tar czf $OUT/partial.tgz --exclude=checkpoints r logs sb oi 2>/dev/null ) &
WD=$!
wait $(jobs -p | grep -v "^$WD$")
kill $WD 2>/dev/null
echo "all done $((SECONDS-T0)) s"
cp /tmp/r/machine.txt $OUT/
cd /tmp && tar czf $OUT/gpu-runs.tgz --exclude=checkpoints r logs && ls -la $OUT
