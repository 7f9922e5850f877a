"""CFLGT: the gradient trajectory (eqs. 6-8) and Alg. 1 on small real-MNIST federations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedcluster.algorithms.cflgt import CFLGT, CFLGTState
from fedcluster.algorithms.cflgt_trajectory import gradient_trajectories
from fedcluster.clustering.validity import ari
from fedcluster.data.federation import Federation
from fedcluster.data.sources import Split
from fedcluster.engine.flat import weighted_average
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError
from fedcluster.protocol.channel import Traffic
from fedcluster.protocol.client_side import ClientBatch
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context

# Scenario 1 of CFLGT Sec. V-A: 5 label pairs (two of them share a label).
PAIRS = [(0, 1), (1, 3), (2, 5), (4, 7), (6, 8)]
MLP = {"hidden": [64]}  # a small MLP 784-64-10 keeps the tests fast


@pytest.fixture(scope="module")
def mnist(shared_dataset) -> Split:
    """Real MNIST training digits (skipped if absent, failed under CI=true)."""
    return shared_dataset("mnist").train


def label_set_federation(
    split: Split,
    label_sets: list[tuple[int, ...]],
    per_label: list[int],
    test_per_label: int = 10,
    seed: int = 0,
) -> Federation:
    """Client i holds ``per_label[i]`` distinct images of each label of ``label_sets[i % S]``."""
    y = split.y.numpy()
    rng = np.random.default_rng(seed)
    pools = {c: list(rng.permutation(np.flatnonzero(y == c))) for c in range(10)}
    train, test, groups = [], [], []
    for i, size in enumerate(per_label):
        g = i % len(label_sets)
        parts = [[pools[c].pop() for _ in range(size + test_per_label)] for c in label_sets[g]]
        tr = torch.as_tensor([j for p in parts for j in p[:size]])
        te = torch.as_tensor([j for p in parts for j in p[size:]])
        train.append((split.x[tr], split.y[tr]))
        test.append((split.x[te], split.y[te]))
        groups.append(g)
    return Federation.from_clients(train, test, 10, np.array(groups))


# ------------------------------------------------------------------ trajectory
def _loop_trajectories(model: nn.Module, fed: Federation, normalise: bool) -> torch.Tensor:
    """Eqs. 6 and 8 sample by sample: full d-dim forces, then averaged to scalars."""
    head = model[-1]
    extractor = model[:-1]
    out = torch.zeros(fed.n_clients, head.out_features, 2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(fed.n_clients):
            part = fed.client_slice(i)
            d = head.in_features
            z1 = torch.zeros(head.out_features, d, dtype=torch.float64)
            z2 = torch.zeros(head.out_features, d, dtype=torch.float64)
            for xs, ys in zip(fed.x_train[part], fed.y_train[part], strict=True):
                v = extractor(xs.unsqueeze(0))[0].double()
                p = torch.softmax(head(v.float().unsqueeze(0))[0].double(), dim=0)
                for c in range(head.out_features):
                    if int(ys) == c:
                        z1[c] += (1.0 - p[c]) * v
                    else:
                        z2[c] += p[c] * v
            out[i, :, 0], out[i, :, 1] = z1.mean(dim=1), z2.mean(dim=1)
            if normalise:
                out[i] /= max(part.stop - part.start, 1)
    return out


def _tiny_federation() -> Federation:
    gen = torch.Generator().manual_seed(0)
    train, test = [], []
    for n, labels in ((7, [0, 1, 2]), (5, [0, 1]), (9, [2])):
        y = torch.as_tensor(labels)[torch.randint(len(labels), (n,), generator=gen)]
        train.append((torch.randn(n, 1, 6, 6, generator=gen), y))
        test.append((torch.randn(2, 1, 6, 6, generator=gen), y[:2]))
    return Federation.from_clients(train, test, 3)


TINY_MODELS = {
    "mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(36, 5), nn.ReLU(), nn.Linear(5, 3)),
    "cnn": lambda: nn.Sequential(
        nn.Conv2d(1, 2, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32, 4),
        nn.Sigmoid(),
        nn.Linear(4, 3),
    ),
}


@pytest.mark.parametrize("model_name", list(TINY_MODELS))
@pytest.mark.parametrize("normalise", [True, False])
def test_trajectories_equal_per_sample_loop(model_name, normalise):
    torch.manual_seed(1)
    model = TINY_MODELS[model_name]()
    fed = _tiny_federation()
    sim = Simulator(model, fed, seed=0)
    row = sim.layout.flatten()
    clients = np.arange(fed.n_clients)
    fast = gradient_trajectories(ClientBatch(sim, clients), row, normalise, chunk_size=4)
    expected = _loop_trajectories(model, fed, normalise)
    assert fast.shape == (3, 3, 2) and fast.dtype == torch.float32
    assert torch.allclose(fast.double(), expected, rtol=1e-5, atol=1e-7)
    # Client 1 lacks class 2 and client 2 holds only class 2: no positive samples give Z1 = 0
    # exactly; client 2 has no negative samples of class 2, so that Z2 is 0 too.
    assert fast[1, 2, 0] == 0.0 and torch.all(fast[2, :2, 0] == 0.0) and fast[2, 2, 1] == 0.0
    # A subset of clients, in any order, gets the same rows.
    subset = gradient_trajectories(ClientBatch(sim, np.array([2, 0])), row, normalise)
    assert torch.allclose(subset, fast[[2, 0]], rtol=1e-6, atol=1e-8)


def test_trajectory_needs_a_linear_classifier():
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 4), nn.ReLU(), nn.Bilinear(4, 4, 3))
    sim = Simulator(model, _tiny_federation(), seed=0)
    with pytest.raises(ConfigError, match="nn.Linear"):
        gradient_trajectories(ClientBatch(sim, np.arange(3)), sim.layout.flatten())


# ----------------------------------------------------------------- algorithm
# Client i holds pair i % 5; "unequal": the 4 clients of each pair hold 10, 30, 80, 160 per label.
SIZES = {"equal": [50] * 20, "unequal": [[10, 30, 80, 160][i // 5] for i in range(20)]}


@pytest.fixture(scope="module", params=list(SIZES))
def scenario1(request, mnist) -> Federation:
    """CFLGT scenario 1 in small: 20 clients, 4 per label pair."""
    return label_set_federation(mnist, PAIRS, SIZES[request.param])


def run_rounds(alg, state, rounds: range, selected: np.ndarray) -> tuple[CFLGTState, list[float]]:
    """The state after ``rounds`` and their losses."""
    losses = []
    for rnd in rounds:
        out = alg.run_round(state, rnd, selected)
        state = out.state
        losses.append(out.loss)
    return state, losses


def test_cflgt_finds_the_five_groups(scenario1):
    ctx = make_context(scenario1, **MLP)
    alg = CFLGT(CFLGT.Params(pretrain_rounds=1), ctx)
    state = alg.init_state()
    state, _ = run_rounds(alg, state, range(1, 3), np.arange(20))
    labels = alg.clusters(state)
    assert labels.max() + 1 == 5 and ari(scenario1.groups, labels) == 1.0
    assert state.trajectories.shape == (20, 10, 2)
    assert state.hopkins > 0.75
    assert state.cv.shape == (2,) and np.all(state.cv > 0.0)


def test_without_normalisation_data_size_misleads(mnist):
    fed = label_set_federation(mnist, PAIRS, SIZES["unequal"])
    scores = {}
    for normalise in (True, False):
        alg = CFLGT(CFLGT.Params(pretrain_rounds=0, normalise=normalise), make_context(fed, **MLP))
        state = alg.init_state()
        state = alg.run_round(state, 1, np.arange(20)).state
        scores[normalise] = ari(fed.groups, alg.clusters(state))
    assert scores[True] == 1.0 and scores[False] < 0.5


def test_hopkins_and_cv_tell_iid_from_label_skew(mnist):
    """Sec. IV-D: AP returns clusters even on IID data; Hopkins and cv show there are none."""
    stats = {}
    for name, sets in (("iid", [tuple(range(10))]), ("pairs", PAIRS)):
        fed = label_set_federation(mnist, sets, [10] * 20 if name == "iid" else SIZES["equal"])
        alg = CFLGT(CFLGT.Params(pretrain_rounds=0), make_context(fed, **MLP))
        state = alg.init_state()
        state = alg.run_round(state, 1, np.arange(20)).state
        stats[name] = (state.hopkins, state.cv, alg.clusters(state).max() + 1)
    assert stats["iid"][2] > 1 and stats["iid"][0] < 0.75 < stats["pairs"][0]
    assert np.all(stats["iid"][1] < stats["pairs"][1])


@pytest.fixture(scope="module")
def equal_scenario(mnist) -> Federation:
    return label_set_federation(mnist, PAIRS, SIZES["equal"])


def test_cflgt_schedule_and_bytes(equal_scenario):
    ctx = make_context(equal_scenario, **MLP)
    d, n, c = ctx.dim, 20, 10
    alg = CFLGT(CFLGT.Params(pretrain_rounds=1), ctx)
    state = alg.init_state()
    selected = np.array([1, 4, 7])
    # Round 1: FedAvg with the runner's selection.
    state = alg.run_round(state, 1, selected).state
    assert (ctx.channel.traffic.down, ctx.channel.traffic.up) == (
        3 * d * FLOAT_BYTES,
        3 * (d * FLOAT_BYTES + INT_BYTES),
    )
    assert np.all(alg.clusters(state) == -1)
    rows, model_of = alg.eval_rows(state)
    assert torch.equal(rows, state.global_model[None]) and np.all(model_of == 0)
    # Round 2: every client receives the model and uploads 2·C floats; nobody trains.
    ctx.channel.traffic = Traffic()
    pretrained = state.global_model.clone()
    out = alg.run_round(state, 2, selected)
    assert np.isnan(out.loss)
    state = out.state
    assert (
        ctx.channel.traffic.up == n * 2 * c * FLOAT_BYTES
        and ctx.channel.traffic.down == n * d * FLOAT_BYTES
    )
    labels = alg.clusters(state)
    assert torch.equal(state.models, pretrained.expand(5, -1))
    # Round 3: 20% of all clients (4), drawn by CFLGT, train their cluster's model.
    ctx.channel.traffic = Traffic()
    state = alg.run_round(state, 3, selected).state
    assert (ctx.channel.traffic.down, ctx.channel.traffic.up) == (
        4 * d * FLOAT_BYTES,
        4 * (d * FLOAT_BYTES + INT_BYTES),
    )
    trained = alg.participants(state, 3, selected)
    assert len(trained) == 4 and not set(trained) <= set(selected)
    for k in range(5):
        members = trained[labels[trained] == k]
        if len(members) == 0:
            assert torch.equal(state.models[k], pretrained)
            continue
        local = ctx.channel.backend.train(members, pretrained, ctx.train, 3).rows
        sizes = torch.as_tensor(equal_scenario.train_sizes[members])
        assert torch.allclose(state.models[k], weighted_average(local, sizes), atol=1e-6)
    rows, model_of = alg.eval_rows(state)
    assert rows.shape == (5, d) and np.array_equal(model_of, labels)


def test_cflgt_participant_sampling(equal_scenario):
    state = CFLGTState(
        global_model=torch.zeros(1),
        models=torch.zeros(5, 1),
        assign=np.arange(20) % 5,
        excluded=np.zeros(20, bool),
    )
    selected = np.array([0, 3])
    for sampling, count in (("global", 4), ("per-cluster", 5)):
        params = CFLGT.Params(cluster_fraction=0.2, sampling=sampling)
        alg = CFLGT(params, make_context(equal_scenario, **MLP))
        drawn = alg.participants(state, 7, selected)
        assert len(drawn) == count and len(np.unique(drawn)) == count
        assert np.array_equal(drawn, alg.participants(state, 7, selected))
        if sampling == "per-cluster":
            assert np.array_equal(np.sort(state.assign[drawn]), np.arange(5))
    alg = CFLGT(CFLGT.Params(cluster_fraction=None), make_context(equal_scenario, **MLP))
    assert np.array_equal(alg.participants(state, 7, selected), selected)


def test_cflgt_is_deterministic(equal_scenario):
    runs = []
    for _ in range(2):
        alg = CFLGT(CFLGT.Params(pretrain_rounds=1), make_context(equal_scenario, seed=3, **MLP))
        state = alg.init_state()
        state, losses = run_rounds(alg, state, range(1, 5), np.arange(0, 20, 2))
        runs.append((losses, state))
    (loss_a, a), (loss_b, b) = runs
    assert np.array_equal(loss_a, loss_b, equal_nan=True)
    assert torch.equal(a.models, b.models)
    assert torch.equal(a.trajectories, b.trajectories)
    assert np.array_equal(a.assign, b.assign) and a.hopkins == b.hopkins
