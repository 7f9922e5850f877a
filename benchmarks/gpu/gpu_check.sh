#!/bin/bash
# The GPU checks, as run on an H200 (docs/benchmarks.md "GPU"):
# the same small federation on cpu and cuda (MLP kernel and CNN autograd path, every
# algorithm), then bench_ifca (fp32, bf16), bench_round and bench_cnn with --device cuda.
# Run from the repository root with the data under .gpudata/ (mnist/ and cifar10/; a
# 400-per-class CIFAR-10 subset zip suffices for bench_cnn) and $OUT set to a folder.
export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'bf16', torch.cuda.is_bf16_supported())"
lscpu | grep "Model name"
T0=$SECONDS
run() { timeout 120 python3 -m fedcluster.cli run benchmarks/gpu/smoke.yaml --quiet --no-report "$@" > /tmp/run.log 2>&1; grep -B12 -m1 "Error" /tmp/run.log; tail -2 /tmp/run.log; }
CNN=(--set model.name=cnn --set 'model.options={}' --set 'algorithms=[{name: fedavg}, {name: ifca, params: {n_clusters: 4}}, {name: jgl, params: {n_clusters: 4}}, {name: dcfl}, {name: fedgroup, params: {n_groups: 4, pretrain_scale: 6}}]')
for dev in cpu cuda; do
  s=$SECONDS; run --set device=$dev --out /tmp/s/mlp-$dev; echo "smoke mlp $dev $((SECONDS-s)) s"
  s=$SECONDS; run --set device=$dev "${CNN[@]}" --out /tmp/s/cnn-$dev; echo "smoke cnn $dev $((SECONDS-s)) s"
done
python3 benchmarks/gpu/compare.py /tmp/s
echo "== bench_ifca fp32 at $((SECONDS-T0)) s"
timeout 150 python3 benchmarks/performance/bench_ifca.py --device cuda --rounds 2 --ref-clients 240 --data-dir .gpudata --out $OUT/ifca-gpu.json 2>&1 | tail -25
echo "== bench_ifca bf16 at $((SECONDS-T0)) s"
timeout 100 python3 benchmarks/performance/bench_ifca.py --device cuda --rounds 2 --ref-clients 240 --precision bf16 --data-dir .gpudata --out $OUT/ifca-gpu-bf16.json 2>&1 | tail -12
echo "== bench_round at $((SECONDS-T0)) s"
timeout 90 python3 benchmarks/performance/bench_round.py --device cuda --rounds 3 --wait-quiet 0 --skip-flower --data-dir .gpudata --out $OUT/round-gpu.json 2>&1 | tail -25
echo "== bench_cnn at $((SECONDS-T0)) s"
timeout 100 python3 -m benchmarks.performance.bench_cnn --device cuda --rounds 2 --models jgl-cnn,lenet,resnet8,lenet-dropout --data-dir .gpudata --out $OUT/cnn-gpu.json 2>&1 | tail -14
echo "== done at $((SECONDS-T0)) s"
