"""Flower apps for ``bench_round.py``: the JGL MLP workload on Flower's simulation engine.

Written the way Flower's PyTorch quickstart (``flwr new``, Message API) writes a
client, but with the same data access as the plain loop of
:mod:`fedcluster.engine.reference`, so only the engine differs:

- ``client_app`` (a :class:`flwr.clientapp.ClientApp`): loads the global
  parameters into an ``nn.Module``, trains one epoch with batches by index
  slicing over the client's samples (the batch plan of
  :func:`fedcluster.protocol.batches.batch_plan`, so the batches equal the
  simulator's), ``torch.optim.SGD``, no DataLoader, and replies with the new
  ``state_dict`` and ``num-examples``.
- :class:`TimedFedAvg`: :class:`flwr.serverapp.strategy.FedAvg` that records
  when each round is configured and when its aggregate is ready.
- :func:`make_server_app`: a :class:`flwr.serverapp.ServerApp` running that
  strategy for a number of rounds, with no federated evaluation.

The packed client data reaches the Ray actors as a file whose path travels in
the train config; each actor process loads it once and keeps it (as it keeps
its ``nn.Module``), Flower's best case: nothing per message but the parameters.
This module must be importable by the actors (``bench_round.py`` runs from the
``benchmarks`` folder, which Flower puts on the actors' ``PYTHONPATH``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining, batch_plan

_CACHE: dict[str, Any] = {}


def _workload(path: str) -> dict[str, Any]:
    """The packed train data and a model of this process, loaded once per path."""
    if _CACHE.get("path") != path:
        data = torch.load(path, weights_only=True)
        hidden = [int(h) for h in data["hidden"]]
        model = build_model(
            "mlp", tuple(data["input_shape"]), int(data["n_classes"]), hidden=hidden
        )
        _CACHE.clear()
        _CACHE.update(data, path=path, model=model)
    return _CACHE


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One client's local epoch: the plain loop of ``fedcluster.engine.reference``."""
    config = msg.content["config"]
    torch.set_num_threads(int(config["threads"]))
    data = _workload(str(config["data"]))
    model = data["model"]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    client = int(context.node_config["partition-id"])
    offsets = data["offsets"]
    lo, hi = int(offsets[client]), int(offsets[client + 1])
    x, y = data["x"][lo:hi], data["y"][lo:hi]
    cfg = LocalTraining(lr=float(config["lr"]), batch_size=int(config["batch-size"]), epochs=1)
    rnd = int(config["server-round"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    total, steps = 0.0, 0
    for idx in batch_plan(hi - lo, cfg, int(config["seed"]), "train", rnd, client):
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        total += float(loss.detach())
        steps += 1
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train-loss": total / max(steps, 1), "num-examples": hi - lo}),
        }
    )
    return Message(content=content, reply_to=msg)


class TimedFedAvg(FedAvg):
    """FedAvg over all nodes, no federated evaluation, with per-round timestamps.

    ``starts[r]``: ``perf_counter`` when round ``r`` is configured (before its
    messages are sent); ``ends[r]``: when its aggregate is ready; ``probes[r]``:
    what ``probe`` returned at those two moments (e.g. CPU counters). ``first``
    keeps the aggregate of round 1 for the correctness check. ``before_round``
    runs before a round's clock starts (e.g. to wait for a quiet machine).
    """

    def __init__(
        self,
        n_clients: int,
        probe: Callable[[], Any] | None = None,
        before_round: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=n_clients,
            min_available_nodes=n_clients,
        )
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.probes: dict[int, list[Any]] = {}
        self.first: ArrayRecord | None = None
        self._probe = probe
        self._before_round = before_round

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self._before_round is not None:
            self._before_round()
        if self._probe is not None:
            self.probes[server_round] = [self._probe()]
        self.starts[server_round] = time.perf_counter()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.ends[server_round] = time.perf_counter()
        if self._probe is not None:
            self.probes[server_round].append(self._probe())
        if server_round == 1:
            self.first = arrays
        return arrays, metrics


def make_server_app(
    strategy: TimedFedAvg,
    initial: dict[str, torch.Tensor],
    num_rounds: int,
    config: dict[str, Any],
) -> ServerApp:
    """A ServerApp that runs ``strategy`` from the ``initial`` state_dict."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial),
            num_rounds=num_rounds,
            train_config=ConfigRecord(config),
        )

    return app
