"""Malformed uploads (NaN / Inf) are rejected before they reach any model, for every algorithm."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import fedcluster.algorithms.cflgt as cflgt_module
from fedcluster.algorithms import ALGORITHMS
from fedcluster.algorithms.base import Algorithm, State
from fedcluster.protocol.channel import UpdateBound
from tests.helpers import make_context, rotated_digits

N_CLIENTS = 8
MLP = {"hidden": [16]}

# Small parameters under which every algorithm clusters within the first rounds.
PARAMS: dict[str, dict] = {
    "fedavg": {},
    "fedprox": {},
    "fedavg-ft": {},
    "ifca": {"n_clusters": 2},
    "jgl": {"n_clusters": 2},
    "cfl": {"warmup_rounds": 1, "eps1": 1e3, "eps2": 0.0},  # splits whenever it may
    "dcfl": {},
    "fedgroup": {"n_groups": 2, "pretrain_scale": 4},  # every client pre-trains in round 1
    "fedgrouprox": {"n_groups": 2, "pretrain_scale": 4},
    "fesem": {"n_clusters": 2},
    "flhc": {"pretrain_rounds": 1, "n_clusters": 2},
    "cflgt": {"pretrain_rounds": 1, "cluster_fraction": None},
    "pacfl": {"n_clusters": 2},
    "flux": {"pretrain_rounds": 1},
    "wecfl": {"n_clusters": 2},
    "cflgp": {"n_clusters": 2},
    "clove": {"n_clusters": 2},
    "fedgwc": {},
    "pfedgraph": {},
}
UPLOADS_NOTHING = {"local"}  # its models never leave the clients: nothing to reject
OWN_TRAINING = {"fedem": "components", "fedrc": "components", "fedsoft": "row"}
"""Algorithms that train through a computation of their own (not ``sim.train``): their
model upload field, corrupted where the reply leaves the backend."""

# Corrupted clients per round (all: every client asked to train); round 2 is the
# clustering round of FL+HC and CFLGT.
EVERYONE = "everyone"
SCHEDULE = {1: [1, 6], 2: [3], 3: EVERYONE, 4: [], 5: [2, 5]}


@pytest.fixture(scope="module")
def federation():
    return rotated_digits(n_groups=2, clients_per_group=N_CLIENTS // 2, per_client=40)


class Corruptor:
    """Wraps ``sim.train``: the rows of the ``bad`` clients come back with NaN or ±Inf."""

    def __init__(self, train) -> None:
        self.train = train
        self.bad: list[int] | str = []
        self.corrupted: list[int] = []

    def __call__(self, clients, *args, **kwargs):
        result = self.train(clients, *args, **kwargs)
        rows = result.rows.clone()
        for i, c in enumerate(np.asarray(clients)):
            if self.bad == EVERYONE or c in self.bad:
                if len(self.corrupted) % 2:
                    rows[i] = float("inf") if c % 2 else -float("inf")
                else:
                    rows[i, c] = float("nan")
                self.corrupted.append(int(c))
        result.rows = rows
        return result


def corrupt(ctx, monkeypatch) -> Corruptor:
    corruptor = Corruptor(ctx.channel.backend.train)
    monkeypatch.setattr(ctx.channel.backend, "train", corruptor)
    return corruptor


def tensors(value) -> list[torch.Tensor]:
    """Every tensor in a (nested) state value."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, State):
        return tensors(vars(value))
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors(v)]
    return []


def changed(before, after) -> bool:
    """Whether the tensors of a state value differ (in number, shape or values)."""
    old, new = tensors(before), tensors(after)
    return len(old) != len(new) or not all(map(torch.equal, old, new))


def assert_finite(alg: Algorithm, state: State) -> None:
    for key, value in vars(state).items():
        for t in tensors(value):
            assert torch.isfinite(t).all(), f"non-finite values in state[{key!r}]"
    rows, _ = alg.eval_rows(state)
    assert torch.isfinite(rows).all()


def assert_same_state(before: State, after: State) -> None:
    assert vars(before).keys() == vars(after).keys()
    for key in vars(before):
        a, b = getattr(before, key), getattr(after, key)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), key
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b, equal_nan=True), key
        elif isinstance(a, list):
            assert all(map(np.array_equal, a, b)) and len(a) == len(b), key
        else:
            assert a == b or (a != a and b != b), key


def test_every_uploading_algorithm_is_covered():
    shipped = {n for n, cls in ALGORITHMS.items() if cls.__module__.startswith("fedcluster.")}
    assert set(PARAMS) | set(OWN_TRAINING) == shipped - UPLOADS_NOTHING


@pytest.mark.parametrize("name", sorted(OWN_TRAINING))
def test_non_finite_model_uploads_of_own_computations_are_rejected(federation, monkeypatch, name):
    cls = ALGORITHMS[name]
    ctx = make_context(federation, **MLP)
    alg = cls(cls.Params(), ctx)
    backend, field, bad = ctx.channel.backend, OWN_TRAINING[name], [1, 6]
    run = backend.run

    def corrupted(computation, clients, request):
        returned = run(computation, clients, request)
        if field in returned.fields:
            rows = returned.fields[field].clone()
            for i, c in enumerate(np.asarray(clients)):
                if c in bad:
                    rows[i].view(-1)[c] = float("nan")
            returned.fields[field] = rows
        return returned

    monkeypatch.setattr(backend, "run", corrupted)
    state = alg.init_state()
    everyone = np.arange(N_CLIENTS)
    for rnd in (1, 2):
        out = alg.run_round(state, rnd, everyone)
        state = out.state
        assert np.isfinite(out.loss)
        rows, _ = alg.eval_rows(state)  # (FedSoft's importances of a rejected client stay NaN:
        assert torch.isfinite(rows).all()  # "never estimated", fedsoft.FedSoftState)
    assert sorted(set(ctx.rejected)) == bad


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_non_finite_uploads_are_rejected(federation, monkeypatch, name):
    cls = ALGORITHMS[name]
    ctx = make_context(federation, **MLP)
    alg = cls(cls.Params(**PARAMS[name]), ctx)
    corruptor = corrupt(ctx, monkeypatch)
    state = alg.init_state()
    initial = copy.deepcopy(state)
    everyone = np.arange(N_CLIENTS)
    for rnd, bad in SCHEDULE.items():
        corruptor.bad = bad
        before = copy.deepcopy(state)
        out = alg.run_round(state, rnd, everyone)
        assert_same_state(before, state)  # the round leaves the state it was given as it was
        state = out.state
        loss = out.loss
        assert_finite(alg, state)
        if bad == EVERYONE:  # nothing accepted: nothing changes
            assert np.isnan(loss)
            assert_same_state(before, state)
        else:
            assert np.isfinite(loss) or (name == "cflgt" and rnd == 2)  # nobody trains
    assert {1, 6, 2, 5} <= set(corruptor.corrupted)
    assert sorted(ctx.rejected) == sorted(corruptor.corrupted)
    assert any(changed(getattr(initial, key), getattr(state, key)) for key in vars(initial)), (
        "no model was trained"
    )
    labels = alg.clusters(state)
    assert labels is None or (labels >= 0).any()


def test_cflgt_rejects_non_finite_trajectories(federation, monkeypatch):
    """Trajectories are checked like models; rejected clients stay unassigned (−1)."""
    cls = ALGORITHMS["cflgt"]
    ctx = make_context(federation, **MLP)
    alg = cls(cls.Params(pretrain_rounds=1, cluster_fraction=None), ctx)
    bad: list[int] = []
    compute = cflgt_module.gradient_trajectories

    def trajectories(batch, row, normalise=True):
        traj = compute(batch, row, normalise)
        traj[bad[:1], 0, 0] = float("nan")
        traj[bad[1:], :, 1] = float("inf")
        return traj

    monkeypatch.setattr(cflgt_module, "gradient_trajectories", trajectories)
    state = alg.init_state()
    everyone = np.arange(N_CLIENTS)
    state = alg.run_round(state, 1, everyone).state

    bad[:] = everyone.tolist()  # every trajectory rejected: no clustering, retried next round
    out = alg.run_round(state, 2, everyone)
    state = out.state
    assert np.isnan(out.loss)
    assert not alg.clustered(state) and state.trajectories is None
    assert sorted(ctx.rejected) == everyone.tolist()

    ctx.rejected.clear()
    bad[:] = [0, 5]
    state = alg.run_round(state, 3, everyone).state
    assert ctx.rejected == [0, 5]
    assign = alg.clusters(state)
    assert (
        alg.clustered(state)
        and assign[0] == assign[5] == -1
        and (np.delete(assign, [0, 5]) >= 0).all()
    )
    assert state.trajectories.shape[0] == N_CLIENTS - 2
    assert_finite(alg, state)

    pretrained = state.global_model.clone()
    state = alg.run_round(state, 4, everyone).state  # the unassigned clients do not train
    assert ctx.rejected == [0, 5]
    rows, model_of = alg.eval_rows(state)
    assert torch.equal(rows[model_of[0]], pretrained) and torch.equal(rows[model_of[5]], pretrained)
    assert not torch.equal(rows[model_of[1]], pretrained)


def test_fedgroup_retries_the_cold_start_with_too_few_updates(federation, monkeypatch):
    cls = ALGORITHMS["fedgroup"]
    ctx = make_context(federation, **MLP)
    alg = cls(cls.Params(n_groups=2, pretrain_scale=1), ctx)
    corruptor = corrupt(ctx, monkeypatch)
    state = alg.init_state()
    everyone = np.arange(N_CLIENTS)
    corruptor.bad = EVERYONE
    out = alg.run_round(state, 1, everyone)
    state = out.state
    assert np.isnan(out.loss)
    assert not state.grouped and state.cold_start_retries == 1
    assert len(ctx.rejected) == 2  # the two pre-training clients; nobody else trained
    corruptor.bad = []
    out = alg.run_round(state, 2, everyone)
    state = out.state
    assert np.isfinite(out.loss)
    assert state.grouped and (state.assign >= 0).all()
    assert_finite(alg, state)


def test_dcfl_rejected_newcomer_stays_unassigned(federation, monkeypatch):
    cls = ALGORITHMS["dcfl"]
    ctx = make_context(federation, **MLP)
    alg = cls(cls.Params(), ctx)
    corruptor = corrupt(ctx, monkeypatch)
    state = alg.init_state()
    state = alg.run_round(state, 1, np.arange(6)).state
    corruptor.bad = [7]
    state = alg.run_round(state, 2, np.arange(N_CLIENTS)).state  # newcomers 6 and 7
    assert state.assign[6] >= 0 and state.assign[7] == -1
    assert ctx.rejected == [7]  # rejected as a newcomer, then sat the round out
    assert_finite(alg, state)


def test_fesem_seeds_only_with_enough_accepted_models(federation, monkeypatch):
    cls = ALGORITHMS["fesem"]
    ctx = make_context(federation, **MLP)
    alg = cls(cls.Params(n_clusters=2), ctx)
    corruptor = corrupt(ctx, monkeypatch)
    state = alg.init_state()
    corruptor.bad = list(range(1, N_CLIENTS))  # one accepted model for two centres
    out = alg.run_round(state, 1, np.arange(N_CLIENTS))
    state = out.state
    assert np.isfinite(out.loss)
    assert not state.seeded and (state.assign < 0).all()
    corruptor.bad = []
    state = alg.run_round(state, 2, np.arange(N_CLIENTS)).state
    assert state.seeded and (state.assign >= 0).all()
    assert_finite(alg, state)


def test_finite_and_norm_checks_are_exact_at_float32_extremes(federation):
    ctx = make_context(federation, hidden=[8])
    clients = np.arange(4)
    huge = torch.tensor(
        [
            [3e38, 3e38, 0.0],  # finite, but its float32 sum overflows
            [1.0, float("inf"), -float("inf")],
            [float("nan"), 0.0, 0.0],
            [1e20, 1e20, 0.0],  # finite; float32 squares overflow
        ]
    )
    finite = ctx.channel.accept_finite(clients, huge, rnd=1, what="update")
    assert finite.tolist() == [True, False, False, True]
    ctx.channel.bound = UpdateBound(norm_factor=None, max_norm=1e21)
    kept = ctx.channel.accept_bounded(clients, huge, torch.zeros_like(huge), finite, rnd=1)
    assert kept.tolist() == [False, False, False, True]  # ‖row 3‖ = 1.41e20 ≤ 1e21 < ‖row 0‖
