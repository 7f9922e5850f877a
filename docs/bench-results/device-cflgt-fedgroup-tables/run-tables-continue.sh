#!/bin/bash
# The second device call (the machine still warm, /tmp/r from run-tables.sh): every
# unfinished job resumed from its checkpoint for 215 s more, then packed as before.
cd /tmp/r && export PYTHONPATH=/tmp/site:$OLDPWD/src:$OLDPWD PYTHONUNBUFFERED=1 FEDCLUSTER_DATA=/tmp/gd OMP_NUM_THREADS=1
c=0
for d in *; do
  [ -f $d/summary.md ] || { taskset -c $c timeout 215 python3 -m fedcluster.cli resume $d --quiet --no-report > /tmp/logs/$d.r.log 2>&1 & }
  c=$((c+1))
done
wait
for d in *; do tail -n1 $d/metrics.csv | cut -d, -f1-4 | sed "s/^/$d /"; done
tar czf $OUT/s1.tgz s1-* && tar czf $OUT/s2.tgz s2-* && tar czf $OUT/s3-cflgt.tgz s3-cflgt && tar czf $OUT/s3-flhc.tgz s3-flhc && tar czf $OUT/s3-flhc10.tgz s3-flhc-10 && tar czf $OUT/s3-small.tgz s3-fed*
cd /tmp && tar czf $OUT/logs.tgz logs
