"""The cluster choice on the device (``choice_on_device``; JGL Alg. 1, lines 3-12).

The device receives the K models (JGL: and their last updates Δw_k, eq. 2),
chooses by eq. 4 (IFCA: the lowest loss), trains the chosen model and uploads
it with the cluster id, in one message. Checked against a client-by-client
loop of the same steps, against the default two-message protocol (equal
models, clusters and bytes where no tie and no empty cluster occurs), and
for Sec. II-C's fix as an allocation in the next round's request.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.ifca import IFCA
from fedcluster.algorithms.jgl import JGL, jgl_scores, pin_empty_clusters
from fedcluster.protocol.channel import UpdateBound
from fedcluster.rng import derive_seed, numpy_rng
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context, rotated_digits

N = 6


def _setup(cls, init: str = "random", **params):
    fed = rotated_digits(n_groups=2, clients_per_group=N // 2)
    ctx = make_context(fed, hidden=[8])
    alg = cls(cls.Params(n_clusters=2, init=init, choice_on_device=True, **params), ctx)
    return fed, ctx, alg, alg.init_state()


def _loop_round(alg, ctx, models, delta, rnd):
    """One round, client by client: the choice (the printed eq. 4 from the client's own
    products, or the loss), ties from the client's own stream, training from the
    chosen model, and the per-cluster average (uniform: JGL eq. 7; IFCA: by samples)."""
    sim, p = ctx.channel.backend, alg.params
    tie_seed = derive_seed(ctx.seed, f"{alg.name}/ties", rnd)
    rows, choice = [], []
    for c in range(N):
        if alg.name == "jgl":
            loss, sq, dot = sim.losses_and_gradient_products(
                np.array([c]), models, delta, ctx.train, rnd, "decide"
            )
            b = min(int(ctx.train_sizes[c]), ctx.train.batch_size)  # eq. 1 sums the batch
            score = jgl_scores(
                loss * b, sq * b * b, dot * b, delta.double().square().sum(1), p.lam
            )[0]
        else:
            loss, _ = sim.losses_and_grads(
                np.array([c]), models, ctx.train, rnd, "decide", with_grads=False
            )
            score = -loss[0].double()
        best = np.flatnonzero(score.numpy() == score.numpy().max())
        tie = numpy_rng(tie_seed, "device", c).random(len(score))
        k = int(np.arange(len(score))[best][np.argmax(tie[best])]) if len(best) > 1 else best[0]
        choice.append(k)
        rows.append(sim.train(np.array([c]), models[k], ctx.train, rnd, "train").rows[0])
    choice = np.array(choice)
    new = models.clone()
    for k in range(len(models)):
        mine = np.flatnonzero(choice == k)
        if len(mine):
            w = ctx.train_sizes[mine] if alg.name == "ifca" else np.ones(len(mine))
            w = torch.as_tensor(w / w.sum(), dtype=torch.float32)
            new[k] = (torch.stack([rows[i] for i in mine]) * w.unsqueeze(1)).sum(0)
    return new, choice


@pytest.mark.parametrize("init", ["random", "same"])  # "same": every score ties in round 1
@pytest.mark.parametrize("cls", [IFCA, JGL])
def test_the_device_choice_equals_a_client_by_client_loop(cls, init):
    params = {"lam": 0.5, "empty_cluster_fix": False} if cls is JGL else {}
    _, ctx, alg, state = _setup(cls, init, **params)
    for rnd in (1, 2, 3):
        models, delta = state.models.clone(), state.delta.clone()
        want_models, want_choice = _loop_round(alg, ctx, models, delta, rnd)
        state = alg.run_round(state, rnd, np.arange(N)).state
        assert np.array_equal(state.assign, want_choice)
        assert torch.allclose(state.models, want_models, atol=1e-6)
    if init == "same":  # the ties were broken per client, not all the same way
        assert len(set(state.assign.tolist())) == 2


@pytest.mark.parametrize("cls", [IFCA, JGL])
def test_without_ties_or_empty_clusters_both_protocols_give_the_same_run(cls):
    """Random initial models (no exact tie), no empty-cluster fix: the one-message
    protocol trains the same models as the decision query + training, and counts the
    same bytes (the K models (JGL: and Δw) down; the model and the cluster id up)."""
    params = {"lam": 0.5, "similarity": "euclidean", "empty_cluster_fix": False}
    runs = []
    for on_device in (False, True):
        fed = rotated_digits(n_groups=2, clients_per_group=N // 2)
        ctx = make_context(fed, hidden=[8])
        p = cls.Params(n_clusters=2, choice_on_device=on_device, **(params if cls is JGL else {}))
        alg = cls(p, ctx)
        state = alg.init_state()
        traffic = []
        for rnd in (1, 2, 3):
            ctx.channel.start_round()
            state = alg.run_round(state, rnd, np.arange(N)).state
            traffic.append((ctx.channel.traffic.down, ctx.channel.traffic.up))
        runs.append((state, traffic))
    (default, t_default), (device, t_device) = runs
    assert torch.equal(default.models, device.models)
    assert np.array_equal(default.assign, device.assign)
    assert t_default == t_device
    shared = 2 if cls is JGL else 1  # the models (and JGL's updates)
    ints = 1 if cls is JGL else 2  # the cluster id (IFCA: and the sample count)
    d = ctx.dim
    assert t_device[0] == (
        N * shared * 2 * d * FLOAT_BYTES,
        N * (d * FLOAT_BYTES + ints * INT_BYTES),
    )


def test_pins_allocate_one_device_to_each_cluster_no_asked_device_was_last_in():
    last = np.array([0, 0, 0, 1, -1, 0])
    pins = pin_empty_clusters(last, 4, np.random.default_rng(0))
    # clusters 2 and 3 get one device each, from cluster 0 (the only one with spares)
    assert sorted(pins[pins >= 0].tolist()) == [2, 3]
    assert set(np.flatnonzero(pins >= 0)) <= {0, 1, 2, 5}
    assert pins[3] == -1 and pins[4] == -1  # cluster 1's only device; a device never seen
    assert (pin_empty_clusters(np.array([0, 1, 1]), 2, np.random.default_rng(0)) == -1).all()
    assert (pin_empty_clusters(np.full(3, -1), 2, np.random.default_rng(0)) == -1).all()


def test_an_empty_cluster_gets_a_pinned_device_in_the_next_round():
    """Sec. II-C on the device: model 1 is so bad that round 1 leaves cluster 1 empty;
    round 2's request allocates one device to it, which trains model 1 (Δw_1 ≠ 0)."""
    _, ctx, alg, state = _setup(JGL, lam=0.2)
    ctx.channel.bound = UpdateBound(norm_factor=None)  # the pinned device's update is large
    state.models[1] = state.models[0] + 50.0
    state = alg.run_round(state, 1, np.arange(N)).state
    assert (state.assign == 0).all() and not state.delta[1].any()
    state = alg.run_round(state, 2, np.arange(N)).state
    assert (state.assign == 1).sum() == 1
    assert state.delta[1].abs().sum() > 0
    off = JGL(JGL.Params(n_clusters=2, choice_on_device=True, empty_cluster_fix=False), ctx)
    kept = off.init_state()
    kept.models[1] = kept.models[0] + 50.0
    for rnd in (1, 2):
        kept = off.run_round(kept, rnd, np.arange(N)).state
    assert (kept.assign == 0).all()  # without the fix cluster 1 stays empty


def test_an_out_of_range_cluster_id_is_rejected(monkeypatch):
    """A device that uploads a cluster id outside 0..K-1 is rejected, not aggregated."""
    from dataclasses import replace

    from fedcluster.algorithms import ifca, jgl

    _, ctx, alg, state = _setup(IFCA)
    run = jgl.CHOOSE_AND_TRAIN.batched_run

    def broken(batch, request):
        out = run(batch, request)
        out["cluster"][batch.ids == 0] = 7
        return out

    monkeypatch.setattr(ifca, "CHOOSE_AND_TRAIN", replace(jgl.CHOOSE_AND_TRAIN, batched_run=broken))
    ctx.channel.start_round()
    state = alg.run_round(state, 1, np.arange(N)).state
    assert ctx.channel.rejected == [0] and state.assign[0] == -1
    assert (state.assign[1:] >= 0).all()
