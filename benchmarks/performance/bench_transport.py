"""The distributed backend's transport, measured: torch.distributed (gloo) against Ray.

What a worker of ``backend: distributed`` does each request: receive a request,
compute, send back the clients' rows. This script times the two engines a
backend could sit on, on this machine, one worker process each:

- start-up: from nothing to a worker that has answered one request
  (gloo: spawn a process, ``init_process_group`` over TCP on 127.0.0.1, one round
  trip; Ray: ``ray.init`` of a local cluster, one actor, one call);
- a reply of ``--sizes`` MB of float32 rows from the worker to the driver, median
  of ``--repeats`` (gloo: ``dist.send``/``dist.recv`` of the raw bytes, as the
  backend sends tensors; Ray: an actor method returning the tensor, ``ray.get``,
  and returning a numpy array, which Ray's object store hands over without a
  copy), as seconds and GB/s.

Run from the repository root (Ray installs with the ``flower`` extra)::

    python -m benchmarks.performance.bench_transport --sizes 8,80,400 --out transport.json
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from multiprocessing import get_context
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import save_run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_worker(port: int, sizes: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    ping = torch.zeros(1)
    dist.recv(ping, src=0)
    dist.send(ping + 1, dst=0)
    for mb in sizes:
        rows = torch.ones(mb * 2**20 // 4)
        for _ in range(repeats):
            dist.recv(ping, src=0)  # the request
            dist.send(rows.view(torch.uint8), dst=0)
    dist.destroy_process_group()


def gloo(sizes: list[int], repeats: int) -> dict[str, Any]:
    start = time.perf_counter()
    port = _free_port()
    worker = get_context("spawn").Process(target=_gloo_worker, args=(port, sizes, repeats))
    worker.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    ping = torch.zeros(1)
    dist.send(ping, dst=1)
    dist.recv(ping, src=1)
    startup = time.perf_counter() - start
    replies = {}
    for mb in sizes:
        raw = torch.empty(mb * 2**20, dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            dist.send(ping, dst=1)
            dist.recv(raw, src=1)
            times.append(time.perf_counter() - t)
        replies[mb] = statistics.median(times)
    worker.join()
    dist.destroy_process_group()
    return {"startup_seconds": startup, "reply_seconds": replies}


def ray_engine(sizes: list[int], repeats: int) -> dict[str, Any]:
    import ray

    start = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Worker:
        def rows(self, mb: int) -> torch.Tensor:
            return torch.ones(mb * 2**20 // 4)

        def array(self, mb: int) -> Any:
            return torch.ones(mb * 2**20 // 4).numpy()

        def ping(self) -> int:
            return 1

    worker = Worker.remote()  # type: ignore[attr-defined]
    ray.get(worker.ping.remote())
    startup = time.perf_counter() - start
    out: dict[str, Any] = {"startup_seconds": startup}
    for kind, method in (("reply_seconds", worker.rows), ("numpy_reply_seconds", worker.array)):
        replies = {}
        for mb in sizes:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                torch.as_tensor(ray.get(method.remote(mb)))
                times.append(time.perf_counter() - t)
            replies[mb] = statistics.median(times)
        out[kind] = replies
    ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,80,400", help="reply sizes in MB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    load_before = os.getloadavg()
    ray_results = ray_engine(sizes, args.repeats)
    results = {
        "gloo": gloo(sizes, args.repeats),
        "ray": ray_results,
        "ray-numpy": {
            "startup_seconds": ray_results["startup_seconds"],
            "reply_seconds": ray_results["numpy_reply_seconds"],
        },
    }
    print(
        f"{'engine':<6}{'start-up s':>12}" + "".join(f"{f'{mb} MB s (GB/s)':>20}" for mb in sizes)
    )
    for name, r in results.items():
        cells = "".join(
            f"{r['reply_seconds'][mb]:>10.3f} ({mb / 1024 / r['reply_seconds'][mb]:5.2f})    "
            for mb in sizes
        )
        print(f"{name:<10}{r['startup_seconds']:12.2f}  {cells}")
    save_run(args.out, results, load_before, sizes_mb=sizes, repeats=args.repeats)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
