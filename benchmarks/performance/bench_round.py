# ruff: noqa: E402  (the run-as-module shim below precedes the imports)
"""Round speed on the JGL setting: fedcluster's simulator vs a plain loop vs Flower.

The simulator's headline benchmark. One FedAvg round -- all 80
clients train one local epoch (B = 32, lr 0.05, plain SGD) from the same
global row, then the sample-weighted average -- on the JGL MNIST setting
(80 clients x 200 real MNIST samples, MLP 784-512-128-10), timed in one process:

(a) ``Simulator.train`` (MLP kernel) for ``group_size`` in {1, 2, 4, 8};
(b) ``fedcluster.engine.reference.reference_train``: one ``nn.Module`` per
    client, batches by index slicing, ``torch.optim.SGD``, no DataLoader;
(c) Flower 1.42's simulation engine (Ray backend, 80 supernodes, Message API
    ``ServerApp``/``ClientApp``, ``flwr.serverapp.strategy.FedAvg``) running the
    same client loop (see ``flower_workload.py``), for several client
    resource settings; Flower's best is the one compared against.

It also measures the machine's fp32 matmul peak, counts the round's matmul
FLOPs and reports the roofline time and the fraction of it the simulator
reaches, checks that the simulator's round equals the plain loop's (and
Flower's), and prints a table; ``--out`` writes everything as JSON.
``--profile`` adds a ``torch.profiler`` breakdown of one simulator round.

On a shared machine every timed round records the CPU share other processes
used meanwhile (Linux ``/proc``); the script waits for a quiet machine before
each round (``--wait-quiet``) and reports medians over the quiet rounds
(``--max-foreign``), with the minimum and the count of quiet rounds beside.

Data: 4 clusters x 20 clients with the class mix of JGL Fig. 2 (MNIST), each
client exactly 200 training samples (``cluster_table(samples_per_client=200)``)
and 20 test samples, packed with ``Federation.from_clients``.

Run from the repository root::

    pip install -e '.[flower]'   # Flower part; --skip-flower runs without it
    python benchmarks/performance/bench_round.py --rounds 5 --out round.json
    python benchmarks/performance/bench_round.py --device cuda --rounds 3 --data-dir DIR \\
        --out gpu.json

With ``--device cuda`` the federation, the simulator and the plain loop run on
the GPU (timers bracket ``torch.cuda.synchronize()``), the roofline peak is the
GPU's fp32 ``torch.mm`` throughput and Flower (a CPU engine) is skipped.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: as the module (as_module.py)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.as_module import run_as_module

    run_as_module(__file__)
    raise SystemExit(0)

import argparse
import importlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.common import add_device_argument, synchronize
from fedcluster.algorithms.base import init_row
from fedcluster.data.federation import Federation
from fedcluster.data.partitions import ClientTestSpec, cluster_table
from fedcluster.data.sources import ENV_DATA, load_dataset
from fedcluster.engine.device import resolve_device
from fedcluster.engine.flat import ParamLayout, weighted_average
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining, batch_plan
from fedcluster.rng import numpy_rng

REPO = Path(__file__).resolve().parents[2]
N_CLUSTERS, PER_CLUSTER, TRAIN_SIZE, TEST_SIZE = 4, 20, 200, 20
HIDDEN = (512, 128)
BATCH, LR, SEED = 32, 0.05, 0
GROUP_SIZES = (1, 2, 4, 8)
THREADS = 2
CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --------------------------------------------------------------------- machine load
@dataclass(frozen=True)
class CpuSample:
    """Busy CPU seconds of the whole machine and of this process tree (Linux ``/proc``)."""

    busy: float
    own: float


def cpu_sample() -> CpuSample | None:
    """A snapshot of the CPU counters, or ``None`` where ``/proc`` is missing."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]] + [0] * 8
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return CpuSample((user + nice + system + irq + softirq + steal) / CLK, _tree_ticks() / CLK)


def _tree_ticks() -> int:
    """CPU ticks of this process and all its descendants (Ray's workers included)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        rest = text[text.rfind(")") + 2 :].split()  # fields 3.. of proc(5) stat
        parent[int(entry.name)] = int(rest[1])
        ticks[int(entry.name)] = sum(int(v) for v in rest[11:15])  # u/s time, reaped children
    root, inside = os.getpid(), {}

    def mine(pid: int) -> bool:
        path = []
        while pid not in inside and pid > 1 and pid != root:
            path.append(pid)
            pid = parent.get(pid, 0)
        verdict = pid == root or inside.get(pid, False)
        inside.update(dict.fromkeys(path, verdict))
        return verdict

    return sum(t for pid, t in ticks.items() if mine(pid))


def foreign_share(a: CpuSample | None, b: CpuSample | None, wall: float) -> float | None:
    """Share of the machine's CPUs used by other processes (and the hypervisor) meanwhile."""
    if a is None or b is None or wall <= 0:
        return None
    foreign = (b.busy - a.busy) - (b.own - a.own)
    return max(0.0, foreign) / (wall * (os.cpu_count() or 1))


def measure(fn: Callable[[], object]) -> tuple[float, float | None]:
    """Wall seconds of ``fn()`` and the foreign CPU share during it."""
    synchronize()
    a = cpu_sample()
    t = time.perf_counter()
    fn()
    synchronize()
    wall = time.perf_counter() - t
    return wall, foreign_share(a, cpu_sample(), wall)


def wait_quiet(limit: float, max_wait: float, window: float = 0.5) -> float:
    """Wait until other processes use at most ``limit`` of the CPUs (up to ``max_wait`` s)."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait:
        a = cpu_sample()
        time.sleep(window)
        share = foreign_share(a, cpu_sample(), window)
        if share is None or share <= limit:
            break
    return time.perf_counter() - start


def summarize(samples: list[tuple[float, float | None]], limit: float) -> dict[str, Any]:
    """Median over the rounds that ran on a quiet machine (all rounds if none did)."""
    secs = [s for s, _ in samples]
    clean = [s for s, f in samples if f is None or f <= limit]
    return {
        "median": statistics.median(clean or secs),
        "clean_rounds": len(clean),
        "rounds": len(secs),
        "median_all": statistics.median(secs),
        "min": min(secs),
        "seconds": secs,
        "foreign_cpu_share": [f for _, f in samples],
    }


# --------------------------------------------------------------------- workload
def build_workload(data_dir: str | Path) -> tuple[Federation, nn.Module]:
    """80 clients x 200 MNIST samples in JGL's four clusters, and the JGL MLP."""
    ds = load_dataset("mnist", data_dir)
    assert ds.test is not None
    part = cluster_table(
        ds.train.y.numpy(),
        ds.test.y.numpy(),
        numpy_rng(SEED, "bench/partition"),
        table="jgl-mnist",
        clients_per_cluster=PER_CLUSTER,
        samples_per_client=TRAIN_SIZE,
        test=ClientTestSpec(size=TEST_SIZE),
    )
    test_split = ds.train if part.test_pool == "train" else ds.test

    def take(split: Any, ix: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(ix, dtype=np.int64))
        return split.x[idx], split.y[idx]

    fed = Federation.from_clients(
        [take(ds.train, ix) for ix in part.train],
        [take(test_split, ix) for ix in part.test],
        len(ds.classes),
        part.groups,
    )
    model = build_model("mlp", fed.input_shape, fed.n_classes, hidden=list(HIDDEN))
    return fed, model


# --------------------------------------------------------------------- roofline
def matmul_peak(
    sizes: tuple[int, ...] = (256, 512, 1024, 1536, 2048, 3072),
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """``torch.mm`` throughput of square products on ``device`` (fp32 unless ``dtype``
    says otherwise); the best size is the peak.

    Each size is timed several times and its fastest run counts (noise from
    other processes only ever adds time).
    """
    gen = torch.Generator().manual_seed(0)
    per_size = {}
    a0 = cpu_sample()
    t0 = time.perf_counter()
    for n in sizes:
        a = torch.randn(n, n, generator=gen).to(device, dtype)
        b = torch.randn(n, n, generator=gen).to(device, dtype)
        c = torch.empty(n, n, device=device, dtype=dtype)
        torch.mm(a, b, out=c)
        reps = max(5, min(50, int(3e9 / (2 * n**3)) + 1))
        best = float("inf")
        for _ in range(reps):
            synchronize()
            t = time.perf_counter()
            torch.mm(a, b, out=c)
            synchronize()
            best = min(best, time.perf_counter() - t)
        per_size[n] = 2 * n**3 / best / 1e9
    top = max(per_size, key=per_size.__getitem__)
    return {
        "gflops": per_size[top],
        "size": top,
        "per_size_gflops": per_size,
        "foreign_cpu_share": foreign_share(a0, cpu_sample(), time.perf_counter() - t0),
    }


def round_flops(fed: Federation, dims: list[tuple[int, int]]) -> dict[str, Any]:
    """Useful matmul FLOPs of one round (every client one epoch), padding excluded.

    Per sample and Linear layer (in -> out): forward 2·in·out; weight gradient
    2·in·out; input gradient 2·in·out for every layer but the first (the
    images need no gradient). Bias adds, ReLU, softmax/cross-entropy and the
    SGD update are not counted (they are O(out), not O(in·out), per sample).
    """
    samples = int(fed.train_sizes.sum())
    fwd = sum(2 * i * o for i, o in dims)
    wgrad = fwd
    igrad = sum(2 * i * o for i, o in dims[1:])
    per_sample = fwd + wgrad + igrad
    return {
        "samples": samples,
        "per_sample": {"forward": fwd, "weight_grad": wgrad, "input_grad": igrad},
        "total": per_sample * samples,
    }


def shape_matmul_time(
    fed: Federation, dims: list[tuple[int, int]], reps: int = 3, device: torch.device | str = "cpu"
) -> float:
    """Time of the round's matmuls alone, one client at a time, at their real shapes.

    Every batch of every client as bare ``torch.mm`` calls (forward, weight
    gradient, input gradient) on preallocated tensors: what per-client matmuls
    of B = 32 rows cost on this machine, without any other work (fastest run).
    """
    sizes = [len(b) for n in fed.train_sizes for b in _plan(int(n), 0, 0)]
    bsz = sorted(set(sizes))
    dev = {"device": device}
    w = [torch.randn(o, i, **dev) for i, o in dims]
    acts = {b: [torch.randn(b, i, **dev) for i, _ in dims] for b in bsz}
    grads = {b: [torch.randn(b, o, **dev) for _, o in dims] for b in bsz}
    outs = {b: [torch.empty(b, o, **dev) for _, o in dims] for b in bsz}
    gw = [torch.empty(o, i, **dev) for i, o in dims]
    gin = {b: [torch.empty(b, i, **dev) for i, _ in dims] for b in bsz}

    def one_round() -> None:
        for b in sizes:
            a, g, out, gi = acts[b], grads[b], outs[b], gin[b]
            for k in range(len(dims)):
                torch.mm(a[k], w[k].t(), out=out[k])
            for k in range(len(dims) - 1, -1, -1):
                torch.mm(g[k].t(), a[k], out=gw[k])
                if k > 0:
                    torch.mm(g[k], w[k], out=gi[k])

    one_round()
    return min(measure(one_round)[0] for _ in range(reps))


def _plan(n: int, rnd: int, client: int) -> list[torch.Tensor]:
    return batch_plan(n, LocalTraining(lr=LR, batch_size=BATCH), SEED, "train", rnd, client)


def linear_dims(model: nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]


# --------------------------------------------------------------------- rounds
def sim_round(sim: Simulator, row: torch.Tensor, cfg: LocalTraining, rnd: int) -> torch.Tensor:
    fed = sim.federation
    clients = np.arange(fed.n_clients)
    rows = sim.train(clients, row, cfg, rnd).rows
    return weighted_average(rows, torch.as_tensor(fed.train_sizes))


def plain_round(
    model: nn.Module, fed: Federation, row: torch.Tensor, cfg: LocalTraining, rnd: int
) -> torch.Tensor:
    clients = np.arange(fed.n_clients)
    rows = reference_train(model, fed, clients, row, cfg, SEED, rnd)
    return weighted_average(rows, torch.as_tensor(fed.train_sizes))


def time_local(
    model: nn.Module,
    fed: Federation,
    row: torch.Tensor,
    cfg: LocalTraining,
    rounds: int,
    warmup: int,
    limit: float,
    max_wait: float,
) -> dict[str, list[tuple[float, float | None]]]:
    """(seconds, foreign CPU share) per round of every simulator group size and the plain loop.

    The variants are interleaved round by round (same rounds, same batch
    plans), so a change of machine load hits them alike; the first ``warmup``
    rounds are dropped. Rounds during which other processes used more than
    ``limit`` of the CPUs are marked ``*``; more rounds are run (up to
    ``3 * rounds`` in all) until every variant has ``rounds`` quiet ones.
    Before each measurement it waits (up to ``max_wait`` s) for a quiet machine.
    """
    runs: dict[str, Callable[[int], object]] = {}
    for g in GROUP_SIZES:
        sim = Simulator(model, fed, seed=SEED, group_size=g)
        runs[f"simulator_g{g}"] = lambda rnd, sim=sim: sim_round(sim, row, cfg, rnd)
    runs["plain_loop"] = lambda rnd: plain_round(model, fed, row, cfg, rnd)
    samples: dict[str, list[tuple[float, float | None]]] = {k: [] for k in runs}
    for attempt in range(warmup + 3 * rounds):
        rnd = 1000 + attempt
        parts = []
        for name, fn in runs.items():
            wait_quiet(limit, max_wait)
            dt, share = measure(lambda fn=fn, rnd=rnd: fn(rnd))
            if attempt >= warmup:
                samples[name].append((dt, share))
            noisy = share is not None and share > limit
            parts.append(f"{name} {dt:.3f}s" + (f"*({share:.0%})" if noisy else ""))
        label = "warm-up" if attempt < warmup else f"round {attempt - warmup + 1}"
        print(f"  {label}: " + ", ".join(parts), flush=True)
        quiet = [
            sum(1 for _, f in v if f is None or f <= limit) >= rounds for v in samples.values()
        ]
        if attempt + 1 >= warmup + rounds and all(quiet):
            break
    return samples


def check_equal(
    model: nn.Module, fed: Federation, row: torch.Tensor, cfg: LocalTraining
) -> dict[str, Any]:
    """Round 1 from ``row``: simulator (each group size) vs plain loop, max abs diff."""
    clients = np.arange(fed.n_clients)
    ref_rows = reference_train(model, fed, clients, row, cfg, SEED, 1)
    ref_avg = weighted_average(ref_rows, torch.as_tensor(fed.train_sizes))
    out: dict[str, Any] = {"reference_average": ref_avg}
    for g in GROUP_SIZES:
        sim = Simulator(model, fed, seed=SEED, group_size=g)
        rows = sim.train(clients, row, cfg, 1).rows
        avg = weighted_average(rows, torch.as_tensor(fed.train_sizes))
        out[f"g{g}"] = {
            "client_rows_max_abs_diff": float((rows - ref_rows).abs().max()),
            "average_max_abs_diff": float((avg - ref_avg).abs().max()),
        }
    out["max_param_abs"] = float(ref_rows.abs().max())
    return out


# --------------------------------------------------------------------- Flower
def run_flower(
    model: nn.Module,
    fed: Federation,
    row: torch.Tensor,
    rounds: int,
    num_cpus: float,
    workdir: Path,
    limit: float,
    max_wait: float,
    quiet: bool = True,
) -> dict[str, Any]:
    """``rounds`` FedAvg rounds on Flower's Ray simulation engine; per-round seconds.

    A round lasts from ``configure_train`` (sampling the 80 nodes, building the
    messages) to the end of ``aggregate_train`` (the new global model exists):
    everything Flower does for a round, nothing of its start-up (Ray, actors,
    node registration) or shut-down. Round 1 is warm-up (each actor process
    loads the data file and builds its model then) and is not counted. The
    foreign CPU share of each round is measured as for the other variants
    (Ray's processes are children of this one, so they count as its own), and
    before each round's clock starts it waits for a quiet machine.
    """
    import flwr
    from flwr.simulation import run_simulation

    # Ray's workers import the ClientApp's module by the name it has here.
    apps = importlib.import_module(
        f"{__package__}.flower_workload" if __package__ else "flower_workload"
    )

    data_path = workdir / "federation.pt"
    if not data_path.exists():
        torch.save(
            {
                "x": fed.x_train,
                "y": fed.y_train,
                "offsets": torch.as_tensor(fed.train_offsets),
                "input_shape": list(fed.input_shape),
                "n_classes": fed.n_classes,
                "hidden": list(HIDDEN),
            },
            data_path,
        )
    layout = ParamLayout(model)
    initial = {k: v.clone() for k, v in layout.unflatten(row).items()}
    threads = max(1, int(num_cpus))
    config = {
        "data": str(data_path),
        "lr": LR,
        "batch-size": BATCH,
        "seed": SEED,
        "threads": threads,
    }
    strategy = apps.TimedFedAvg(
        fed.n_clients, probe=cpu_sample, before_round=lambda: wait_quiet(limit, max_wait)
    )
    server_app = apps.make_server_app(strategy, initial, rounds + 1, config)
    backend_config = {
        "client_resources": {"num_cpus": num_cpus, "num_gpus": 0.0},
        "init_args": {"num_cpus": THREADS, "num_gpus": 0},
    }
    if quiet:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    run_simulation(
        server_app=server_app,
        client_app=apps.client_app,
        num_supernodes=fed.n_clients,
        backend_config=backend_config,
    )
    total = time.perf_counter() - t0
    done = sorted(strategy.ends)
    if len(done) != rounds + 1:
        raise RuntimeError(f"Flower finished {len(done)} of {rounds + 1} rounds")
    per_round = [strategy.ends[r] - strategy.starts[r] for r in done]
    shares = [foreign_share(*strategy.probes[r], per_round[i]) for i, r in enumerate(done)]
    start_to_start = [strategy.starts[r + 1] - strategy.starts[r] for r in done[:-1]]
    first = strategy.first
    assert first is not None
    flat = torch.cat([torch.as_tensor(a.numpy()).reshape(-1) for a in first.values()])
    return {
        **summarize(list(zip(per_round[1:], shares[1:], strict=True)), limit),
        "flwr_version": flwr.__version__,
        "client_resources_num_cpus": num_cpus,
        "actors": int(THREADS // num_cpus),
        "torch_threads_per_actor": threads,
        "warmup_round_seconds": per_round[0],
        "round_start_to_start_seconds": start_to_start,
        "total_seconds": total,
        "startup_and_shutdown_seconds": total - sum(per_round),
        "round1_average": flat,
    }


# --------------------------------------------------------------------- profile
def profile_round(sim: Simulator, row: torch.Tensor, cfg: LocalTraining) -> dict[str, Any]:
    """``torch.profiler`` breakdown of one simulator round (self CPU time per op)."""
    from torch.profiler import ProfilerActivity, profile

    sim_round(sim, row, cfg, 7)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        sim_round(sim, row, cfg, 7)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    rows = sorted(
        ({"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in events),
        key=lambda e: -e["self_s"],
    )
    op_total = sum(e["self_s"] for e in rows)
    print(events.table(sort_by="self_cpu_time_total", row_limit=18))
    return {"wall_s_profiled": wall, "op_self_total_s": op_total, "top_ops": rows[:18]}


# --------------------------------------------------------------------- report
def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Flags"):
                value = value.strip()
                if key.strip() == "Flags":
                    value = " ".join(
                        f for f in value.split() if f.startswith(("avx", "fma", "amx"))
                    )
                info[key.strip()] = value
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def default_data_dir() -> Path:
    return Path(os.environ.get(ENV_DATA) or REPO.parent / "shared" / "data")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per variant")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds (simulator, plain)")
    ap.add_argument("--data-dir", default=None, help="data root holding mnist/")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--skip-flower", action="store_true", help="do not run Flower")
    ap.add_argument(
        "--flower-cpus",
        default="0.5,1,2",
        help="Flower client_resources num_cpus values to try (comma-separated)",
    )
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="a round counts as quiet when other processes used at most this CPU share",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=30.0,
        help="before each timed round wait up to this many seconds for a quiet machine",
    )
    ap.add_argument("--profile", action="store_true", help="profile one simulator round")
    ap.add_argument("--flower-logs", action="store_true", help="keep Flower's INFO logs")
    add_device_argument(ap)
    args = ap.parse_args(argv)
    limit = args.max_foreign
    device = resolve_device(args.device)
    if device.type != "cpu" and not args.skip_flower:
        print(f"Flower runs on the CPU only: skipped with --device {args.device}")
        args.skip_flower = True

    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    print(f"threads: torch.get_num_threads() = {torch.get_num_threads()}; load {load_before}")
    fed, model = build_workload(data_dir)
    row = init_row(model, SEED, "init")  # on the CPU: the same start row on every device
    fed, model = fed.to(device), model.to(device)
    gpu = f" ({torch.cuda.get_device_name(0)})" if device.type == "cuda" else ""
    print(f"device: {device}{gpu}")
    cfg = LocalTraining(lr=LR, batch_size=BATCH, epochs=1)
    dims = linear_dims(model)
    print(
        f"workload: {fed.n_clients} clients x {TRAIN_SIZE} MNIST samples "
        f"(JGL Fig. 2 clusters), MLP {'-'.join(str(d[0]) for d in dims)}-{dims[-1][1]} "
        f"(d = {ParamLayout(model).dim}), B = {BATCH}, lr = {LR}, 1 epoch"
    )

    wait_quiet(limit, args.wait_quiet)
    peaks = [matmul_peak(device=device)]
    flops = round_flops(fed, dims)
    wait_quiet(limit, args.wait_quiet)
    shape_s = shape_matmul_time(fed, dims, device=device)
    print(
        f"matmul peak {peaks[0]['gflops']:.1f} GFLOP/s (n = {peaks[0]['size']}); round "
        f"{flops['total'] / 1e9:.2f} GFLOP; bare per-client matmuls at the round's shapes "
        f"{shape_s:.3f}s"
    )

    check = check_equal(model, fed, row, cfg)
    worst = max(check[f"g{g}"]["client_rows_max_abs_diff"] for g in GROUP_SIZES)
    print(f"simulator vs plain loop, round 1: max |diff| of client rows {worst:.2e}")

    print(f"timing {args.rounds} rounds (+{args.warmup} warm-up), interleaved:")
    samples = time_local(model, fed, row, cfg, args.rounds, args.warmup, limit, args.wait_quiet)
    local = {k: summarize(v, limit) for k, v in samples.items()}
    best_g = min(GROUP_SIZES, key=lambda g: local[f"simulator_g{g}"]["median"])
    sim_s = local[f"simulator_g{best_g}"]["median"]
    plain_s = local["plain_loop"]["median"]

    flower: dict[str, Any] = {}
    flower_err = None
    if not args.skip_flower:
        with tempfile.TemporaryDirectory(prefix="bench_round_") as tmp:
            for cpus in (float(c) for c in args.flower_cpus.split(",")):
                print(f"Flower: client_resources num_cpus = {cpus:g} ...", flush=True)
                try:
                    res = run_flower(
                        model,
                        fed,
                        row,
                        args.rounds,
                        cpus,
                        Path(tmp),
                        limit,
                        args.wait_quiet,
                        not args.flower_logs,
                    )
                except ImportError as exc:
                    flower_err = f"Flower not installed: {exc}"
                    print(flower_err)
                    break
                avg = res.pop("round1_average")
                res["round1_vs_plain_max_abs_diff"] = float(
                    (avg - check["reference_average"]).abs().max()
                )
                flower[f"num_cpus={cpus:g}"] = res
                print(
                    f"  rounds: {' '.join(f'{t:.3f}' for t in res['seconds'])}s; median "
                    f"{res['median']:.3f}s ({res['clean_rounds']}/{res['rounds']} quiet); "
                    f"start-up+shut-down {res['startup_and_shutdown_seconds']:.1f}s; round-1 "
                    f"average vs plain loop max |diff| {res['round1_vs_plain_max_abs_diff']:.2e}",
                    flush=True,
                )
    torch.set_num_threads(THREADS)

    prof = None
    if args.profile:
        wait_quiet(limit, args.wait_quiet)
        prof = profile_round(Simulator(model, fed, seed=SEED, group_size=best_g), row, cfg)

    wait_quiet(limit, args.wait_quiet)
    peaks.append(matmul_peak(device=device))
    peak = max(peaks, key=lambda p: p["gflops"])
    roofline_s = flops["total"] / (peak["gflops"] * 1e9)
    flower_best = min(flower, key=lambda k: flower[k]["median"]) if flower else None
    flower_s = flower[flower_best]["median"] if flower_best else None
    load_after = os.getloadavg()

    def row_text(name: str, r: dict[str, Any], mark: str = "") -> str:
        quiet = f"{r['clean_rounds']}/{r['rounds']}"
        return f"{name:<28}{r['median']:8.3f}{r['min']:8.3f}{quiet:>8}{mark}"

    lines = [
        "",
        f"seconds per round{'':11}  median     min   quiet",
        "-" * 64,
    ]
    for g in GROUP_SIZES:
        mark = "  <- best" if g == best_g else ""
        lines.append(row_text(f"simulator group_size={g}", local[f"simulator_g{g}"], mark))
    lines.append(row_text("plain nn.Module loop", local["plain_loop"]))
    for k, v in flower.items():
        lines.append(row_text(f"Flower {k}", v, "  <- best" if k == flower_best else ""))
    lines.append(f"{'matmul roofline':<28}{roofline_s:8.3f}   ({peak['gflops']:.1f} GFLOP/s peak)")
    lines.append(f"{'bare per-client matmuls':<28}{shape_s:8.3f}")
    lines.append("-" * 64)
    lines.append(f"simulator vs plain loop     {plain_s / sim_s:8.2f}x  (goal >= 1.5x)")
    if flower_s is not None:
        lines.append(f"simulator vs Flower         {flower_s / sim_s:8.2f}x  (goal >= 4x)")
    lines.append(f"roofline fraction           {roofline_s / sim_s:8.1%}  (aim >= 60%)")
    lines.append(f"torch.get_num_threads()     {torch.get_num_threads():8d}")
    lines.append(f"load average before/after   {load_before} / {load_after}")
    lines.append(f"(quiet: rounds in which other processes used <= {limit:.0%} of the CPUs;")
    lines.append(" medians are over quiet rounds when there are any)")
    print("\n".join(lines))

    result = {
        "machine": machine_info(),
        "torch_num_threads": torch.get_num_threads(),
        "device": str(device),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "max_foreign_cpu_share": limit,
        "workload": {
            "dataset": "mnist",
            "data_dir": str(data_dir),
            "partition": "cluster_table(jgl-mnist, 4x20 clients, samples_per_client=200)",
            "n_clients": fed.n_clients,
            "train_samples_per_client": sorted({int(s) for s in fed.train_sizes}),
            "test_samples_per_client": sorted({int(s) for s in fed.test_sizes}),
            "model": "mlp " + "-".join(str(i) for i, _ in dims) + f"-{dims[-1][1]}",
            "dim": ParamLayout(model).dim,
            "batch_size": BATCH,
            "lr": LR,
            "epochs": 1,
        },
        "rounds": args.rounds,
        "warmup": args.warmup,
        "seconds_per_round": local,
        "best_group_size": best_g,
        "simulator_seconds": sim_s,
        "plain_loop_seconds": plain_s,
        "flower": flower,
        "flower_error": flower_err,
        "flower_best": flower_best,
        "flower_seconds": flower_s,
        "speedup_vs_plain": plain_s / sim_s,
        "speedup_vs_flower": None if flower_s is None else flower_s / sim_s,
        "matmul_peak": peak,
        "matmul_peak_runs": [p["gflops"] for p in peaks],
        "round_flops": flops,
        "roofline_seconds": roofline_s,
        "roofline_fraction": roofline_s / sim_s,
        "bare_matmuls_at_round_shapes_seconds": shape_s,
        "equality": {k: v for k, v in check.items() if k != "reference_average"},
        "profile": prof,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=float) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
