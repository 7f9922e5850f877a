"""DCFL (Augello et al. 2023, Alg. 1): rotation groups, Dunn index, newcomers (eq. 6)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from fedcluster.algorithms.base import RoundOutput
from fedcluster.algorithms.dcfl import DCFL, DCFLState
from fedcluster.clustering.distances import DCFL_VARIANTS, dcfl_distance_matrix
from fedcluster.clustering.validity import ari
from fedcluster.data.federation import Federation
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import FLOAT_BYTES, make_context

N_GROUPS = 4
PER_GROUP = 5


@pytest.fixture(scope="module")
def rotated(shared_dataset) -> Federation:
    """20 clients of real MNIST; client i's images are rotated by 90°·(i mod 4) (its group)."""
    ds = shared_dataset("mnist")
    rng = np.random.default_rng(0)
    n = N_GROUPS * PER_GROUP
    groups = np.arange(n) % N_GROUPS
    tr, te = rng.permutation(len(ds.train.y))[: n * 100], rng.permutation(len(ds.test.y))[: n * 20]
    train, test = [], []
    for c in range(n):
        k = int(groups[c])
        i_tr = torch.as_tensor(tr[c * 100 : (c + 1) * 100])
        i_te = torch.as_tensor(te[c * 20 : (c + 1) * 20])
        train.append((torch.rot90(ds.train.x[i_tr], k, dims=(-2, -1)), ds.train.y[i_tr]))
        test.append((torch.rot90(ds.test.x[i_te], k, dims=(-2, -1)), ds.test.y[i_te]))
    return Federation.from_clients(train, test, 10, groups)


def make_dcfl(federation: Federation, seed: int = 0, **params) -> DCFL:
    train = LocalTraining(lr=0.1, batch_size=20)
    ctx = make_context(federation, "mlp", seed=seed, train=train, hidden=[32])
    return DCFL(DCFL.Params(**params), ctx)


def run(
    alg: DCFL, state: DCFLState, rounds: range, selected: np.ndarray
) -> tuple[DCFLState, list[RoundOutput]]:
    """The state after ``rounds`` and every round's output."""
    outs = []
    for rnd in rounds:
        outs.append(alg.run_round(state, rnd, selected))
        state = outs[-1].state
    return state, outs


def test_recovers_rotation_groups_and_dunn_index_ends_above_one(rotated):
    alg = make_dcfl(rotated)
    state = alg.init_state()
    everyone = np.arange(rotated.n_clients)
    state, outs = run(alg, state, range(1, 2), everyone)
    # one cluster C_0 in round 1: DI = 0, so it clusters (Alg. 1)
    assert outs[0].diagnostics == {"dunn": 0.0, "reclusterings": 1.0}
    assert state.reclusterings == 1
    state, outs = run(alg, state, range(2, 7), everyone)
    assert ari(rotated.groups, alg.clusters(state)) == 1.0
    assert len(state.models) == N_GROUPS
    assert outs[-1].diagnostics["dunn"] > 1.0
    accuracy = alg.evaluate(state, 6).accuracy.mean()
    assert accuracy > 0.6


def test_newcomers_join_their_groups_cluster(rotated):
    alg = make_dcfl(rotated)
    state = alg.init_state()
    late = np.array([3, 18, 19])  # groups 3, 2, 3
    initial = np.setdiff1d(np.arange(rotated.n_clients), late)
    state, _ = run(alg, state, range(1, 5), initial)
    assert (state.assign[late] == -1).all()
    assert ari(rotated.groups[initial], state.assign[initial]) == 1.0
    rows, model_of_client = alg.eval_rows(state)
    assert torch.equal(rows[model_of_client[19]], state.models.mean(dim=0))  # W_G

    dim = alg.ctx.dim
    alg.ctx.channel.traffic.down = alg.ctx.channel.traffic.up = 0
    choice = alg.assign_newcomer(state, 19, 5)
    assert (
        alg.ctx.channel.traffic.down == alg.ctx.channel.traffic.up == dim * FLOAT_BYTES
    )  # W_G down, update up
    mates = state.assign[initial[rotated.groups[initial] == rotated.groups[19]]]
    assert choice.tolist() == [mates[0]] and (mates == mates[0]).all()
    assert state.assign[19] == -1  # placing is a question: the state is left as it was

    alg.ctx.channel.traffic.down = alg.ctx.channel.traffic.up = 0
    everyone = np.arange(rotated.n_clients)
    state, _ = run(alg, state, range(5, 6), everyone)  # clients 3, 18 and 19 are newcomers
    assert (
        alg.ctx.channel.traffic.down
        == alg.ctx.channel.traffic.up
        == (len(everyone) + 3) * dim * FLOAT_BYTES
    )
    assert ari(rotated.groups, state.assign) == 1.0


def test_bytes_per_round_are_exact(rotated):
    alg = make_dcfl(rotated)
    state = alg.init_state()
    selected = np.arange(rotated.n_clients)
    state = alg.run_round(state, 1, selected).state
    # Every client gets its cluster model and uploads one update: d float32 each way.
    assert (
        alg.ctx.channel.traffic.down
        == alg.ctx.channel.traffic.up
        == len(selected) * alg.ctx.dim * FLOAT_BYTES
    )


@pytest.mark.parametrize("variant", DCFL_VARIANTS)
def test_every_distance_variant_runs(rotated, variant):
    alg = make_dcfl(rotated, variant=variant)
    state = alg.init_state()
    state, outs = run(alg, state, range(1, 3), np.arange(rotated.n_clients))
    assert all(np.isfinite(out.loss) for out in outs)
    assert (state.assign >= 0).all() and np.isfinite(outs[-1].diagnostics["dunn"])


def test_preference_sets_the_number_of_clusters(rotated):
    counts = []
    for preference in ("median", 0.0):
        alg = make_dcfl(rotated, preference=preference)
        state = alg.init_state()
        state = alg.run_round(state, 1, np.arange(rotated.n_clients)).state
        counts.append(len(state.models))
    assert counts[0] == N_GROUPS
    assert counts[1] == rotated.n_clients  # preference 0 = the self-similarity: all exemplars


def test_reclustering_with_absent_clients():
    """Absent clients follow their old cluster's majority; clusters nobody attended are kept."""
    x = torch.zeros(6, 1, 2, 2)
    y = torch.zeros(6, dtype=torch.int64)
    fed = Federation.from_clients([(x[i : i + 1], y[i : i + 1]) for i in range(6)], [(x, y)] * 6, 2)
    alg = make_dcfl(fed)
    state = alg.init_state()
    state.assign = np.array([0, 0, 1, 1, 2, 2])
    state.models = torch.arange(3.0).unsqueeze(1).repeat(1, alg.ctx.dim)
    assign, previous = alg._recluster(state, np.array([0, 2, 3]), np.array([0, 1, 1]))
    assert assign.tolist() == [0, 0, 1, 1, 2, 2]
    assert previous.shape == (3, alg.ctx.dim)
    assert torch.equal(previous[2], torch.full((alg.ctx.dim,), 2.0))


def test_same_seed_same_numbers_and_checkpoint_resume(rotated):
    everyone = np.arange(rotated.n_clients)
    alg = make_dcfl(rotated, seed=3)
    full = alg.init_state()
    full, outs = run(alg, full, range(1, 5), everyone)

    again = make_dcfl(rotated, seed=3)
    state = again.init_state()
    state, first = run(again, state, range(1, 3), everyone)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = torch.load(buffer, weights_only=False)
    resumed, rest = run(make_dcfl(rotated, seed=3), resumed, range(3, 5), everyone)

    assert [o.loss for o in first + rest] == [o.loss for o in outs]
    assert [o.diagnostics for o in first + rest] == [o.diagnostics for o in outs]
    assert torch.equal(resumed.models, full.models)
    assert np.array_equal(resumed.assign, full.assign)


def test_a_sample_of_the_updates_finds_the_groups_the_exact_clustering_finds(rotated):
    """Above ``max_exact_participants`` the Dunn index and affinity propagation run on a
    sample of the round's updates and the others join their nearest exemplar: the
    rotation groups are found as by the exact clustering (12 of 20 updates: about 3
    of each group; with 2 per group, 8 or 10 of 20, two groups can stay merged), the
    same seed gives the same models, and at the limit itself every round is exact
    (the same models as without a limit)."""
    everyone = np.arange(rotated.n_clients)

    def final(**params):
        alg = make_dcfl(rotated, **params)
        state = alg.init_state()
        state, _ = run(alg, state, range(1, 7), everyone)
        return alg.clusters(state), state.models

    exact_labels, exact_models = final(max_exact_participants=None)
    sampled_labels, sampled_models = final(max_exact_participants=12)
    assert ari(rotated.groups, exact_labels) == 1.0
    assert ari(rotated.groups, sampled_labels) == 1.0
    assert torch.equal(final(max_exact_participants=12)[1], sampled_models)
    assert torch.equal(final(max_exact_participants=rotated.n_clients)[1], exact_models)


def test_updates_outside_the_sample_join_their_nearest_exemplar_by_eq_2(rotated):
    """The labels of the updates outside the sample are the argmin of the full eq. 2
    distance matrix over the exemplars' columns; the sample keeps its own labels."""
    alg = make_dcfl(rotated, max_exact_participants=6)
    gen = torch.Generator().manual_seed(0)
    origins = torch.randn(16, 30, generator=gen)
    ends = origins + torch.randn(16, 30, generator=gen)
    sample = alg._sample(16, rnd=3)
    assert sample is not None and len(sample) == 6 and (np.diff(sample) > 0).all()
    exemplars = sample[[1, 4]]
    sample_labels = np.array([0, 0, 1, 0, 1, 1])
    sample_labels[[1, 4]] = [0, 1]
    labels = alg._nearest_exemplar(origins, ends, sample, exemplars, sample_labels)
    full = dcfl_distance_matrix(origins, ends)
    rest = np.setdiff1d(np.arange(16), sample)
    np.testing.assert_array_equal(labels[rest], full[rest][:, exemplars].argmin(dim=1).numpy())
    np.testing.assert_array_equal(labels[sample], sample_labels)
