"""Client computations reach their clients only through ClientBatch and ClientContext.

Every built-in registered computation runs against a runner that answers only the
documented :class:`~fedcluster.protocol.client_side.ClientRunner` protocol (any other
attribute of the simulator raises ``AttributeError``), and replies exactly what it
replies with the simulator itself. The batch's own helpers equal their per-client
definitions.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import fedcluster.algorithms  # noqa: F401  (registers the algorithms' client computations)
from fedcluster.algorithms.base import init_row
from fedcluster.algorithms.jgl import CHOOSE_AND_TRAIN
from fedcluster.engine.client_computations import TRAIN
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.privacy.mechanisms import UploadTicket
from fedcluster.protocol.batches import LocalTraining, batch_plan
from fedcluster.protocol.client_side import ClientBatch, ClientRunner
from fedcluster.protocol.computation import COMPUTATIONS, Request
from fedcluster.protocol.secure_sum import secure_request
from tests.helpers import rotated_digits

PROTOCOL = {name for name in vars(ClientRunner) if not name.startswith("_")} | set(
    ClientRunner.__annotations__
)
CFG = LocalTraining(lr=0.1, batch_size=16)
N_CLIENTS = 4
K = 2


class StrictRunner:
    """A runner that is a simulator seen through the ClientRunner protocol only."""

    def __init__(self, runner: Simulator) -> None:
        self._runner = runner

    def __getattr__(self, name: str):
        if name not in PROTOCOL:
            raise AttributeError(f"{name!r} is not part of the ClientRunner protocol")
        return getattr(self._runner, name)


def _requests(model: torch.nn.Module, fed) -> dict[str, list[Request]]:
    """A request for each built-in computation, as its algorithm sends it."""
    rows = torch.stack([init_row(model, 3, "init", k) for k in range(K)])
    directions = rows[1] - rows[0] + torch.zeros_like(rows)
    starts = rows[torch.arange(N_CLIENTS) % K]
    train = {"train": CFG, "round": 2}
    jgl = {"lam": 0.2, "similarity": "cosine", "gradient_sign": "descent", "tie_seed": 5}
    jgl |= {"loss_reduction": "sum", "rule": "jgl"}
    weights = torch.full((N_CLIENTS, K), 1.0 / K, dtype=torch.float64)
    shares = torch.softmax(torch.arange(K * fed.n_classes, dtype=torch.float64).view(K, -1), 1)
    features = int(np.prod(fed.input_shape))
    pacfl = {"n_basis": 2, "per_class": True, "n_classes": fed.n_classes, "n_features": features}
    return {
        "train": [
            Request(shared={"start": rows[0]}, settings=train),
            Request(own={"start": starts}, settings={**train, "classifier_only": True}),
        ],
        "losses": [
            Request(shared={"models": rows}, settings=train),
            Request(shared={"models": rows}, settings={**train, "batches": "all"}),
        ],
        "loss-vectors": [Request(shared={"models": rows}, settings={**train, "batches": "all"})],
        "evaluate": [
            Request(
                shared={"models": rows},
                own={"model_index": torch.arange(N_CLIENTS) % K},
                settings={"split": "train"},
            ),
            Request(own={"model": starts}),
        ],
        "evaluate_models": [Request(shared={"models": rows})],
        "jgl-products": [
            Request(shared={"models": rows, "directions": directions}, settings=train)
        ],
        "choose-and-train": [
            Request(shared={"models": rows, "directions": directions}, settings={**train, **jgl}),
            Request(
                shared={"models": rows},
                settings={**train, **jgl, "rule": "loss"},
                own_settings=tuple({"pin": 1 if i == 0 else -1} for i in range(N_CLIENTS)),
            ),
        ],
        "cflgt-trajectory": [
            Request(shared={"model": rows[0]}, settings={"normalise": n, "n_classes": 10})
            for n in (True, False)
        ],
        "fedsoft-train": [
            Request(
                shared={"models": rows},
                own={"start": starts},
                settings={**train, "lam": 0.1, "smoother": 1e-4},
            )
        ],
        "fedem-train": [
            Request(shared={"components": rows}, own={"weights": weights}, settings=train)
        ],
        "fedem-evaluate": [Request(shared={"components": rows}, own={"weights": weights})],
        "fedrc-train": [
            Request(
                shared={"components": rows, "shares": shares},
                own={"weights": weights},
                settings=train,
            )
        ],
        "pacfl-subspace": [Request(settings=pacfl)],
        "fesem-train-and-choose": [
            Request(
                shared={"centres": rows},
                own={"start": starts},
                settings={**train, "compare": compare},
            )
            for compare in ("parameters", "row")
        ],
        "direction-choose-and-train": [
            Request(
                shared={"models": rows, "directions": rows - rows.mean(0)},
                settings={**train, "rule": rule, "direction_noise": noise, "compare": compare},
            )
            for rule, noise, compare in (
                ("dcfl-complete", [0.01, 0.0], "parameters"),
                ("cosine", [0.0, 0.02], "row"),
            )
        ],
        "flux-descriptor": [
            Request(shared={"model": rows[0]}, settings={"n_classes": fed.n_classes, "latent": 8})
        ],
        "secure-share": [  # a round's contribution: DP-FedAvg's training, IFCA's choice
            secure_request(TRAIN, Request(shared={"start": rows[0]}, settings=train), 0.5),
            secure_request(
                CHOOSE_AND_TRAIN,
                Request(shared={"models": rows}, settings={**train, **jgl, "rule": "loss"}),
                0.5,
            ),
        ],
        "private-start-share": [  # a device's term of each of the private start's sums
            Request(
                shared={"start": rows[0], "basis": torch.eye(8)[:, :4], "centres": rows[:, :4]},
                settings={
                    **train,
                    "purpose": "private-start",
                    "start_step": step,
                    "sketch_dim": 8,
                    "projection_seed": 3,
                    "clip": 1.0,
                    "cell_dims": 2,
                    "grid": 3,
                },
            )
            for step in ("moment", "cells", "clusters", "groups")
        ],
    }


def _built_ins() -> list[str]:
    return sorted(n for n, c in COMPUTATIONS.items() if c.module.startswith("fedcluster."))


@pytest.fixture(scope="module")
def setup():
    fed = rotated_digits(n_groups=2, clients_per_group=2, per_client=40)
    model = build_model("mlp", fed.input_shape, fed.n_classes, hidden=[8])
    return model, fed


def test_every_built_in_computation_has_a_request_here(setup):
    model, fed = setup
    assert sorted(_requests(model, fed)) == _built_ins()


@pytest.mark.parametrize("name", _built_ins())
def test_a_computation_uses_only_the_client_runner_protocol(setup, name):
    """Its reply through a protocol-only runner equals its reply through the simulator
    (the clients out of order, so positions and ids are kept apart)."""
    model, fed = setup
    clients = np.array([2, 0, 3, 1])
    computation = COMPUTATIONS[name]
    for request in _requests(model, fed)[name]:
        real = computation.run(Simulator(model, fed, seed=3), clients, request)
        strict = computation.run(StrictRunner(Simulator(model, fed, seed=3)), clients, request)
        assert sorted(strict) == sorted(real) == sorted(computation.reply)
        for field, value in real.items():
            assert torch.equal(strict[field], value), field


@pytest.mark.parametrize("name", [n for n in _built_ins() if COMPUTATIONS[n].privacy == "release"])
def test_a_local_dp_release_uses_only_the_client_runner_protocol(setup, name):
    """Under client-level local DP each client releases its upload where it is, its noise
    keyed by its id in the run: the same through a protocol-only runner."""
    model, fed = setup
    clients, ids = np.array([2, 0]), np.array([10, 11, 12, 13])
    computation = COMPUTATIONS[name]
    for request in _requests(model, fed)[name]:
        own = [request.own_settings[c] if request.own_settings else {} for c in clients]
        tickets = tuple(
            {**own[j], "ticket": UploadTicket("client", 1.0, 0.5, j, 5)}
            for j in range(len(clients))
        )
        private = replace(
            request,
            own={k: v[clients] for k, v in request.own.items()},
            own_settings=tickets,
            settings={"round": 2, **request.settings},
        )
        plain = replace(private, own_settings=tuple(own))
        replies = [
            computation.run(wrap(Simulator(model, fed, seed=3, client_ids=ids)), clients, r)
            for wrap, r in ((lambda s: s, private), (StrictRunner, private), (lambda s: s, plain))
        ]
        released, strict, unreleased = replies
        for field, value in released.items():
            assert torch.equal(strict[field], value), field
        assert any(not torch.equal(released[f], unreleased[f]) for f in released)


def test_the_trajectory_under_fedbn_uses_only_the_protocol():
    """FedBN: each client's trajectory under its own BatchNorm layers (ClientBatch.personal)."""
    fed = rotated_digits(n_groups=2, clients_per_group=2, per_client=16)
    model = build_model("fedcluster.models:resnet8", fed.input_shape, 10, width=4)
    start = init_row(model, 0, "init")
    request = Request(shared={"model": start}, settings={"normalise": True, "n_classes": 10})
    clients = np.array([1, 3])
    replies = []
    for wrap in (lambda s: s, StrictRunner):
        sim = Simulator(model, fed, seed=0, local_buffers=True)
        sim.train(np.arange(N_CLIENTS), start, CFG, 1)  # each client keeps its own layers
        replies.append(COMPUTATIONS["cflgt-trajectory"].run(wrap(sim), clients, request))
        assert not torch.equal(sim.personal(start, 1), start)
    assert torch.equal(replies[0]["trajectory"], replies[1]["trajectory"])


def test_the_strict_runner_refuses_what_the_protocol_lacks(setup):
    model, fed = setup
    strict = StrictRunner(Simulator(model, fed, seed=0))
    with pytest.raises(AttributeError, match="federation"):
        _ = strict.federation
    assert strict.seed == 0


def test_a_batch_is_its_clients_in_its_order(setup):
    """Ids, sizes, plans and chunks of a batch equal each client's own, in the batch's order."""
    model, fed = setup
    sim = Simulator(model, fed, seed=7, client_ids=np.array([10, 11, 12, 13]))
    batch = ClientBatch(sim, np.array([3, 1]))
    assert len(batch) == 2 and batch.ids.tolist() == [13, 11] and batch.seed == 7
    assert batch.train_sizes.tolist() == [40, 40] and batch.dim == sim.layout.dim
    for j, plan in enumerate(batch.plans(CFG, 4, "train")):
        expected = batch_plan(40, CFG, 7, "train", 4, int(batch.ids[j]))
        assert all(torch.equal(a, b) for a, b in zip(plan, expected, strict=True))
        offset = int(fed.train_offsets[batch.positions[j]])
        simulated = sim.plans(batch.positions[j : j + 1], CFG, 4, "train")[0]
        assert all(torch.equal(a + offset, b) for a, b in zip(plan, simulated, strict=True))
    g = batch.generator(1, "noise", 4)
    assert torch.equal(
        torch.rand(3, generator=g), torch.rand(3, generator=batch.client(1).generator("noise", 4))
    )
    chunks = list(batch.train_chunks([1, 0], chunk_size=30))
    assert [len(y) for _, y, _ in chunks] == [30, 30, 20]
    x = torch.cat([c[0] for c in chunks])
    owner = torch.cat([c[2] for c in chunks])
    assert owner.tolist() == [1] * 40 + [0] * 40
    first, second = sim.client_data(1), sim.client_data(3)
    assert torch.equal(x, torch.cat([first.x_train, second.x_train]))
    assert torch.equal(
        torch.cat([c[1] for c in chunks]), torch.cat([first.y_train, second.y_train])
    )
