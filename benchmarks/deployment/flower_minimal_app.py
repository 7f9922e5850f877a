"""Per-round time of fedcluster's FedAvg against a minimal hand-written Flower app.

Goal: on the same nodes, a fedcluster round through
Flower costs at most 1.1x a round of the smallest Flower app one would write
by hand for the same FedAvg (McMahan et al., 2017: each node trains the
global model on its clients, the server averages weighted by sample count).
Both run on the same kind of deployment (:class:`fedcluster.flower.launcher.LocalDeployment`:
a SuperLink and ``--nodes`` SuperNodes on loopback, ``--isolation process``
with fedcluster's long-lived ClientApp worker per node, each node holding the
same node-local files of the quickstart's federation):

- fedcluster: ``fedcluster flower local`` of the quickstart's FedAvg
  (``run_local``); a round's time is the runner's (``client_seconds`` +
  ``server_seconds`` + ``eval_seconds`` of ``metrics.csv``: training, the
  server's step, the evaluation);
- minimal: the Flower App written below (``minimal_app.py``, about 100
  lines): a ServerApp that, per round, sends the global model to every node
  with ``Grid.send_and_receive`` (Flower's own call, which the Flower
  strategies use), averages the replies by sample count and sends an
  evaluation; a ClientApp that trains the same MLP (784-200-100-10, SGD,
  the config's lr, batch size and epochs) on each of its clients from the
  global model and returns their sample-weighted mean. It caches the node's
  data in the worker process, as fedcluster's ClientApp does.

Rounds after the first are compared (the first loads each node's data and
model on both sides).

    python -m benchmarks.deployment.flower_minimal_app runs/minimal-vs-fedcluster \\
        --rounds 5 --nodes 4
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from fedcluster.config.schema import resolve_config

APP = '''"""A minimal hand-written Flower 1.42 app: FedAvg of an MLP over the nodes' clients."""

import json
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

_DATA = {}


def make_model(inputs, hidden, classes):
    layers, width = [torch.nn.Flatten()], inputs
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, classes))


def node_data(folder):
    if folder not in _DATA:
        clients = []
        for path in sorted(Path(folder).glob("client-*.npz")):
            with np.load(path, allow_pickle=False) as f:
                clients.append({k: torch.from_numpy(f[k]) for k in f.files})
        _DATA[folder] = clients
    return _DATA[folder]


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = msg.content["config"]
    state = msg.content["arrays"].to_torch_state_dict()
    total, mean = 0, None
    for k, c in enumerate(node_data(context.node_config["data"])):
        model = make_model(int(cfg["inputs"]), json.loads(cfg["hidden"]), int(cfg["classes"]))
        model.load_state_dict(state)
        opt = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]))
        gen = torch.Generator().manual_seed(int(cfg["round"]) * 100003 + k)
        x, y, n = c["x_train"], c["y_train"], len(c["y_train"])
        for _ in range(int(cfg["epochs"])):
            order = torch.randperm(n, generator=gen)
            for i in range(0, n, int(cfg["batch_size"])):
                b = order[i : i + int(cfg["batch_size"])]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
                opt.step()
        new = {name: p.detach() * n for name, p in model.state_dict().items()}
        mean = new if mean is None else {name: mean[name] + new[name] for name in mean}
        total += n
    arrays = ArrayRecord({name: v / total for name, v in mean.items()})
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": total})})
    return Message(content, reply_to=msg)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = msg.content["config"]
    model = make_model(int(cfg["inputs"]), json.loads(cfg["hidden"]), int(cfg["classes"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    correct = total = 0
    with torch.no_grad():
        for c in node_data(context.node_config["data"]):
            correct += int((model(c["x_test"]).argmax(1) == c["y_test"]).sum())
            total += len(c["y_test"])
    metrics = MetricRecord({"correct": correct, "num-examples": total})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = dict(context.run_config)
    torch.manual_seed(0)
    model = make_model(int(cfg["inputs"]), json.loads(cfg["hidden"]), int(cfg["classes"]))
    arrays = ArrayRecord(model.state_dict())
    while len(nodes := sorted(grid.get_node_ids())) < int(cfg["nodes"]):
        time.sleep(0.2)
    rounds = []
    for rnd in range(1, int(cfg["rounds"]) + 1):
        config = ConfigRecord({**cfg, "round": rnd})
        start = time.perf_counter()
        content = RecordDict({"arrays": arrays, "config": config})
        asks = [Message(content, dst_node_id=n, message_type="train") for n in nodes]
        replies = [r for r in grid.send_and_receive(asks) if not r.has_error()]
        states = [
            (r.content["arrays"].to_torch_state_dict(), r.content["metrics"]["num-examples"])
            for r in replies
        ]
        total = sum(n for _, n in states)
        arrays = ArrayRecord({k: sum(s[k] * n for s, n in states) / total for k in states[0][0]})
        trained = time.perf_counter()
        content = RecordDict({"arrays": arrays, "config": config})
        asks = [Message(content, dst_node_id=n, message_type="evaluate") for n in nodes]
        evals = [r.content["metrics"] for r in grid.send_and_receive(asks) if not r.has_error()]
        accuracy = sum(m["correct"] for m in evals) / sum(m["num-examples"] for m in evals)
        end = time.perf_counter()
        rounds.append(
            {
                "round": rnd,
                "seconds": end - start,
                "train_seconds": trained - start,
                "eval_seconds": end - trained,
                "accuracy": accuracy,
                "replies": len(replies),
            }
        )
        print(f"minimal: round {rnd}: {end - start:.2f} s, accuracy {accuracy:.4f}", flush=True)
    Path(cfg["out"]).write_text(json.dumps(rounds, indent=1))
'''

PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "minimal-fedavg"
version = "1.0.0"
description = "A minimal hand-written Flower app (fedcluster's benchmark)"
license = "Apache-2.0"
dependencies = ["torch"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedcluster-benchmark"

[tool.flwr.app.components]
serverapp = "minimal_app:server_app"
clientapp = "minimal_app:client_app"

[tool.flwr.app.config]
{settings}
"""


def _toml(value: object) -> str:
    return json.dumps(value)


def run_minimal(config, out: Path, n_nodes: int) -> list[dict]:
    """The minimal app on a SuperLink and ``n_nodes`` SuperNodes holding the config's
    node-local data; its per-round records."""
    from fedcluster.flower.export import export_federation, spread_clients
    from fedcluster.flower.launcher import CONNECTION, LocalDeployment, place_node_data

    folder = out / "deployment"
    manifest = export_federation(config, folder / "export")
    blocks = spread_clients(len(manifest.clients), n_nodes)
    data = place_node_data(folder / "export", blocks, folder / "data")
    shutil.rmtree(folder / "export")
    app = folder / "app"
    app.mkdir()
    (app / "minimal_app.py").write_text(APP)
    settings = {
        "rounds": config.rounds,
        "nodes": n_nodes,
        "inputs": math.prod(manifest.input_shape),
        "hidden": json.dumps(list(config.model.options["hidden"])),
        "classes": manifest.n_classes,
        "lr": float(config.train.lr),
        "batch_size": config.train.batch_size,
        "epochs": config.train.epochs,
        "out": str(out / "minimal.json"),
    }
    text = "\n".join(f"{k} = {_toml(v)}" for k, v in settings.items())
    (app / "pyproject.toml").write_text(PYPROJECT.format(settings=text))
    dep = LocalDeployment(folder)
    try:
        dep.start_superlink()
        for k, (block, path) in enumerate(zip(blocks, data, strict=True)):
            dep.start_node(k, block, path)
        dep.wait_connected()
        dep.flwr("run", str(app), CONNECTION, "--stream", log=folder / "flwr-run.log", timeout=3600)
    finally:
        dep.stop()
    if not (out / "minimal.json").exists():
        raise SystemExit(f"the minimal app wrote no result; see {folder / 'flwr-run.log'}")
    return json.loads((out / "minimal.json").read_text())


def run_fedcluster(config, out: Path, n_nodes: int) -> list[dict]:
    """``fedcluster flower local`` of ``config``; per round the runner's time."""
    from fedcluster.flower.launcher import run_local

    run_local(config, out, n_nodes, emit=lambda s: None)
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    parts = ("client_seconds", "server_seconds", "eval_seconds")
    return [
        {
            "round": int(r["round"]),
            "seconds": sum(float(r[p]) for p in parts),
            "accuracy": float(r["accuracy"]),
        }
        for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="a new folder for both runs")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nodes", type=int, default=4)
    args = p.parse_args(argv)
    out = Path(args.out).absolute()
    out.mkdir(parents=True)
    config = resolve_config(
        preset="quickstart", algorithms=["fedavg"], overrides={"rounds": args.rounds}
    )
    load = [os.getloadavg()]
    results = {}
    for name, run in (("fedcluster", run_fedcluster), ("minimal", run_minimal)):
        start = time.monotonic()
        rounds = run(config, out / name, args.nodes)
        later = [r["seconds"] for r in rounds[1:]]
        results[name] = {
            "rounds": rounds,
            "wall_seconds": time.monotonic() - start,
            "mean_round_after_first": statistics.mean(later),
        }
        print(
            f"{name}: rounds 2..{args.rounds}: {statistics.mean(later):.2f} s per round "
            f"({', '.join(f'{s:.2f}' for s in later)}); accuracy after the last "
            f"{rounds[-1]['accuracy']:.4f}",
            flush=True,
        )
    load.append(os.getloadavg())
    ratio = (
        results["fedcluster"]["mean_round_after_first"]
        / results["minimal"]["mean_round_after_first"]
    )
    print(f"fedcluster / minimal per round: {ratio:.2f}x (goal <= 1.1x); load {load}", flush=True)
    summary = {"config": "quickstart fedavg", "nodes": args.nodes, "load": load, "ratio": ratio}
    (out / "results.json").write_text(json.dumps({**summary, **results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
