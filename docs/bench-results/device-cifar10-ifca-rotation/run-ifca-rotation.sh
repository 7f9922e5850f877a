#!/bin/bash
# Second device call: IFCA rotated CIFAR-10 seeds 1-2 of the three initialisations
# (12 rounds, choices probed every 3) and JGL's CIFAR-10 table with IFCA (3 seeds, 15 rounds).
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
mkdir -p /tmp/gd/cifar10 /tmp/r /tmp/logs && tar -xJf .gpucifar/cifar10-tree.tar.xz -C /tmp/gd/cifar10
python3 -c "from fedcluster.data.sources import load_dataset; ds = load_dataset('cifar10', '/tmp/gd', normalize='none'); print(len(ds.train.y))"
echo "setup $((SECONDS-T0)) s"
L=${L:-185}
core=0
diag() { # name args...
  local name=$1; shift
  taskset -c $core timeout -s INT -k 10 $L python3 -m benchmarks.ifca_cifar_diag --rounds 12 --probe-every 3 --data-dir /tmp/gd --set device=cuda --set eval_every=3 --set checkpoint_every=100 "$@" --out /tmp/r/$name > /tmp/logs/$name.log 2>&1 &
  core=$((core+1))
}
for s in 1 2; do
  diag fixed-s$s --set "seeds=[$s]"
  diag oldinit-s$s --init-batches one --set "seeds=[$s]"
  diag shared-s$s --set algorithms.ifca.shared_layers=all_but_last --set "seeds=[$s]"
done
for s in 0 1 2; do
  taskset -c $core timeout -s INT -k 10 $L python3 -m fedcluster.cli run --preset jgl-mnist --rounds 15 --seed $s --data-dir /tmp/gd --set device=cuda --quiet --no-report --set data.dataset=cifar10 --set data.partition.table=jgl-cifar10 --set model.name=lenet --set 'model.options={}' --set data.partition.relabel=false --set eval_every=1 --set "algorithms=[{name: ifca, label: ifca, params: {n_clusters: 4, weighting: uniform, init: random}}]" --out /tmp/r/j6-ifca-s$s > /tmp/logs/j6-ifca-s$s.log 2>&1 &
  core=$((core+1))
done
wait
echo "done $((SECONDS-T0)) s"
for n in /tmp/logs/*.log; do echo "== $n"; grep "^round" $n | tail -4; done
cd /tmp && tar czf $OUT/gpu2.tgz --exclude=checkpoints r logs && ls -la $OUT
