#!/bin/bash
# Device call: CFLGT Table I/II CIFAR-10 cells on the 16 CPU cores, one job a core,
# checkpoints every 5 rounds; whatever is unfinished at the deadline is resumed on the dev machine.
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 FEDCLUSTER_DATA=/tmp/gd OMP_NUM_THREADS=1
mkdir -p /tmp/gd/cifar10 /tmp/r /tmp/logs && tar -xJf .gpucifar/cifar10-tree.tar.xz -C /tmp/gd/cifar10
{ lscpu | grep -E "Model name|Thread|Core|Socket|MHz"; nproc; python3 -c "import torch; print(torch.__version__)"; } > /tmp/logs/machine.txt 2>&1
echo "setup $((SECONDS-T0)) s"; cat /tmp/logs/machine.txt
LIMIT=$((${DEADLINE:-535} - (SECONDS - T0)))
core=0
job() { # name preset alg
  taskset -c $core timeout $LIMIT python3 -m fedcluster.cli run --preset $2 --algorithms $3 --set eval_every=1 --set checkpoint_every=5 --quiet --no-report --out /tmp/r/$1 > /tmp/logs/$1.log 2>&1 &
  core=$((core+1))
}
for a in cflgt ifca flhc fesem fedavg fedavg-ft fedprox; do job s1-$a cflgt-s1-cifar10 $a; done
for a in fesem flhc fedavg-ft; do job s2-$a cflgt-s2-cifar10 $a; done
for a in cflgt flhc flhc-10 fedavg fedavg-ft fedprox; do job s3-$a cflgt-s3-cifar10 $a; done
wait
echo "jobs ended $((SECONDS-T0)) s"
cd /tmp/r
for d in *; do tail -n1 $d/metrics.csv | cut -d, -f1-4 | sed "s/^/$d /"; [ -f $d/summary.md ] && rm -rf $d/checkpoints; done | tee /tmp/logs/status.txt
tar czf $OUT/s1.tgz s1-* && tar czf $OUT/s2.tgz s2-* && tar czf $OUT/s3-cflgt.tgz s3-cflgt
tar czf $OUT/s3-flhc.tgz s3-flhc && tar czf $OUT/s3-flhc10.tgz s3-flhc-10 && tar czf $OUT/s3-small.tgz s3-fed*
cd /tmp && tar czf $OUT/logs.tgz logs; ls -la $OUT; echo "all done $((SECONDS-T0)) s"
