"""DCFL's eq. 6 and FedGroup's eq. 9 on the device (``choice_on_device``;
fedcluster.algorithms.direction_choice).

The rules against hand computations on hand-made vectors (eq. 2 from a common origin
with the directions' expected noise subtracted, eq. 9's cosine with the noise taken out
of the direction's norm); a round of the batched computation against a client-by-client
loop of the same steps, with and without central DP (whose per-cluster noise z_Δ·C_t/n_k
the next round's request carries); the groups of a small rotation federation found
without privacy; and the settings that cannot run on the device refused.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from fedcluster.algorithms.base import algorithm_params
from fedcluster.algorithms.dcfl import DCFL
from fedcluster.algorithms.direction_choice import PROBE_PURPOSE, direction_scores
from fedcluster.algorithms.fedgroup import FedGroup
from fedcluster.algorithms.ifca import IFCA
from fedcluster.clustering.distances import (
    cosine_to_directions,
    dcfl_distance_to,
    dcfl_distance_to_directions,
)
from fedcluster.config.schema import AlgorithmSpec, resolve_config
from fedcluster.errors import ConfigError
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.experiment.runner import Experiment, resume
from fedcluster.privacy.central import CentralDP
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import make_context, rotated_digits

N_GROUPS = 2
PER_GROUP = 3
N = N_GROUPS * PER_GROUP


# ------------------------------------------------------------------ the rules
def test_eq2_from_a_common_origin_with_the_noise_term_by_hand():
    f64 = torch.float64
    u = torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]], dtype=f64)
    v = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 4.0, 3.0]], dtype=f64)
    s = torch.tensor([0.5, 1.0], dtype=f64)  # per-coordinate noise std of each direction
    noise_sq = 4 * s**2  # d·s²
    got = dcfl_distance_to_directions(u, v, noise_sq)
    for i in range(2):
        for k in range(2):
            end = math.sqrt(max(float(((u[i] - v[k]) ** 2).sum()) - float(noise_sq[k]), 0.0))
            direction = math.sqrt(max(float((v[k] ** 2).sum()) - float(noise_sq[k]), 0.0))
            omega = end / (float(u[i].norm()) + direction)  # eq. 1 from a common origin
            assert got[i, k].item() == pytest.approx(end * math.exp(2 * omega), rel=1e-12)
    # u[0] − v[0] = (1, −1, 0, 0): ‖.‖² = 2, less d·s² = 1 gives |BD| = 1; ‖v[0]‖² − 1 = 4
    assert got[0, 0].item() == pytest.approx(1.0 * math.exp(2 / (3 + math.sqrt(5 - 1))))
    euclid = dcfl_distance_to_directions(u, v, noise_sq, variant="euclidean")
    torch.testing.assert_close(
        euclid, (torch.cdist(u.double(), v.double()) ** 2 - noise_sq.double()).clamp_min(0).sqrt()
    )


@pytest.mark.parametrize("variant", ["complete", "divergence", "euclidean", "cosine"])
def test_without_noise_it_is_dcfls_distance_with_both_origins_at_w_g(variant):
    gen = torch.Generator().manual_seed(0)
    w_g = torch.randn(30, generator=gen, dtype=torch.float64)  # float64: w_g + u exact enough
    u = torch.randn(5, 30, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 30, generator=gen, dtype=torch.float64)
    want = dcfl_distance_to(w_g.expand(5, -1), w_g + u, w_g.expand(3, -1), w_g + v, variant=variant)
    got = dcfl_distance_to_directions(u, v, torch.zeros(3), variant=variant)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_eq9_cosine_with_the_noise_out_of_the_directions_norm_by_hand():
    d = 8
    u = torch.zeros(2, d, dtype=torch.float64)
    u[0, 0], u[1, :2] = 2.0, torch.tensor([1.0, -1.0])
    v = torch.zeros(3, d, dtype=torch.float64)
    v[0, 0], v[1, 1], v[2, 2] = 3.0, 0.5, 1.0
    s = torch.tensor([1.0, 0.1, 0.0], dtype=torch.float64)
    noise_sq = d * s**2
    got = cosine_to_directions(u, v, noise_sq)
    for i in range(2):
        for k in range(3):
            floor = float(s[k]) ** 2 * math.sqrt(2 * d)  # the noise's own spread
            norm = math.sqrt(max(float((v[k] ** 2).sum()) - float(noise_sq[k]), floor))
            want = float(u[i] @ v[k]) / (float(u[i].norm()) * norm)
            assert got[i, k].item() == pytest.approx(max(-1.0, min(1.0, want)), abs=1e-12)
    # ‖v₀‖² − d·s² = 9 − 8 = 1 is below the floor s²·√(2d) = 4: norm 2, cos 6/4 clamped to 1
    assert got[0, 0].item() == 1.0
    assert got[0, 1].item() == 0.0 and got[1, 1].item() < 0.0
    torch.testing.assert_close(cosine_to_directions(u, v), torch.nn.functional.cosine_similarity(
        u.double()[:, None], v.double()[None], dim=2))  # fmt: skip


def test_the_noise_term_removes_the_expected_noise_of_a_released_direction():
    """Averaged over many noisy releases δ + n of one direction, the corrected squared
    distance is ‖u − δ‖² (its standard error: ‖n‖²'s spread s²·√(2d) over √draws)."""
    d, draws, s = 2000, 400, 0.05
    gen = torch.Generator().manual_seed(1)
    u, delta = torch.randn(1, d, generator=gen), torch.randn(1, d, generator=gen)
    noisy = delta + s * torch.randn(draws, d, generator=gen)
    got = dcfl_distance_to_directions(
        u, noisy, torch.full((draws,), d * s * s), variant="euclidean"
    )
    mean_sq = (got**2).mean().item()
    want = ((u - delta) ** 2).sum().item()
    spread = math.sqrt(s**4 * 2 * d + 4 * s**2 * want) / math.sqrt(draws)
    assert abs(mean_sq - want) < 5 * spread
    uncorrected = (torch.cdist(u.double(), noisy.double()) ** 2).mean().item()
    assert uncorrected - want > 0.9 * d * s * s  # what the term takes away


@pytest.mark.parametrize("rule", ["dcfl-complete", "cosine"])
def test_without_the_noise_term_the_larger_clusters_direction_attracts_its_neighbour(rule):
    """A client whose update is cluster 1's direction, cluster 1 small (s₁ = 0.05 per
    coordinate: d·s₁² = 5 against ‖δ‖² = 1) and cluster 0 large (s₀ = 0.005), the two
    directions at cosine 0.6: over many noisy releases the rule with the term chooses
    cluster 1 every time, the same rule without it cluster 0 every time (the noise's own
    spread, s₁²·√(2d) = 0.16, is far below the margins)."""
    d, draws = 2000, 50
    gen = torch.Generator().manual_seed(2)
    basis = torch.linalg.qr(torch.randn(d, 2, generator=gen, dtype=torch.float64))[0].T
    delta = torch.stack([0.6 * basis[0] + 0.8 * basis[1], basis[0]])  # unit, cosine 0.6
    s = torch.tensor([0.005, 0.05], dtype=torch.float64)
    with_term, without = [], []
    for _ in range(draws):
        released = delta + s[:, None] * torch.randn(2, d, generator=gen, dtype=torch.float64)
        u = delta[1:]
        with_term.append(int(direction_scores(u, released, s, rule).argmin()))
        without.append(int(direction_scores(u, released, torch.zeros(2), rule).argmin()))
    assert with_term == [1] * draws
    assert without == [0] * draws


# --------------------------------------------------------- a round, by hand
def _setup(cls, seed: int = 0):
    fed = rotated_digits(n_groups=N_GROUPS, clients_per_group=PER_GROUP, per_client=40)
    ctx = make_context(fed, "mclr", seed=seed, train=LocalTraining(lr=0.1, batch_size=16))
    params = {"n_clusters": 2} if cls is DCFL else {"n_groups": 2}
    return ctx, cls(cls.Params(choice_on_device=True, **params), ctx)


def _install_central(ctx, clip: float = 0.3) -> CentralDP:
    dp = CentralDP(N, seed=3, delta=1e-5, noise_multiplier=1.0, count_noise=5.0,
                   sample_rate=1.0, clip=clip)  # fmt: skip
    ctx.central, ctx.aggregate = dp, dp
    return dp


def _loop_round(alg, ctx, state, rnd):
    """One round, client by client: the probe from W_G, the rule, training from the chosen
    model; then each cluster's aggregate (uniform for DCFL, by samples for FedGroup,
    central DP's own mean when installed) and its step and noise."""
    sim = ctx.channel.backend
    models, directions, noise = state.models, state.directions, state.direction_noise
    rule = "cosine" if alg.name == "fedgroup" else f"dcfl-{alg.params.variant}"
    w_g = models.mean(dim=0)
    rows, choice = [], []
    for c in range(N):
        probe = sim.train(np.array([c]), w_g, ctx.train, rnd, PROBE_PURPOSE).rows[0]
        score = direction_scores((probe - w_g)[None], directions, noise, rule)[0]
        k = int(score.argmin())
        choice.append(k)
        rows.append(sim.train(np.array([c]), models[k], ctx.train, rnd, "train").rows[0])
    choice = np.array(choice)
    if ctx.central is not None:  # the ledger and the adaptive clip see every upload
        ctx.central.observe(np.arange(N), models[torch.as_tensor(choice)], torch.stack(rows))
    new, steps, new_noise = models.clone(), directions.clone(), noise.clone()
    for k in range(len(models)):
        mine = np.flatnonzero(choice == k)
        if not len(mine):
            continue
        members = torch.stack([rows[i] for i in mine])
        if ctx.central is not None:
            new[k] = ctx.central(models[k].expand(len(mine), -1), members)
            new_noise[k] = ctx.central.update_noise * ctx.central.clip / len(mine)
        else:
            w = ctx.train_sizes[mine] if alg.name == "fedgroup" else np.ones(len(mine))
            w = torch.as_tensor(w / w.sum(), dtype=torch.float32)
            new[k] = (members * w.unsqueeze(1)).sum(0)
        steps[k] = new[k] - models[k]
    return new, steps, new_noise, choice


@pytest.mark.parametrize("private", [False, True])
@pytest.mark.parametrize("cls", [DCFL, FedGroup])
def test_a_device_round_equals_a_client_by_client_loop(cls, private):
    ctx, alg = _setup(cls)
    loop_ctx, _ = _setup(cls)
    if private:
        dp, loop_dp = _install_central(ctx), _install_central(loop_ctx)
    state = alg.init_state()
    torch.testing.assert_close(state.directions, state.models - state.models.mean(0))
    for rnd in (1, 2, 3):
        if private:
            dp.start_round(rnd)
            loop_dp.start_round(rnd)
        want = _loop_round(alg, loop_ctx, state, rnd)
        state = alg.run_round(state, rnd, np.arange(N)).state
        assert np.array_equal(state.assign, want[3])
        torch.testing.assert_close(state.models, want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(state.directions, want[1], rtol=0, atol=1e-6)
        torch.testing.assert_close(state.direction_noise, want[2].double())
        if private:  # the clip moves between rounds; the step's noise is the clip it had
            assert (state.direction_noise[np.unique(state.assign)] > 0).all()
            dp.end_round()
            loop_dp.end_round()
    if private:
        assert dp.releases.tolist() == [3] * N  # one aggregate release per upload


@pytest.mark.parametrize(
    "cls,seed",
    [(DCFL, 2), (FedGroup, 1)],
)
def test_the_device_choice_finds_the_rotation_groups_without_privacy(cls, seed):
    """24 clients in 4 rotation groups of digits, mclr, 10 rounds, no DP: the device
    choice ends with the groups (ARI ≥ 0.9). From random initial models, as IFCA's
    choice, other seeds can merge two groups into one cluster."""
    fed = rotated_digits(n_groups=4, clients_per_group=6, per_client=60)
    ctx = make_context(fed, "mclr", seed=seed, train=LocalTraining(lr=0.1, batch_size=16))
    params = {"n_clusters": 4} if cls is DCFL else {"n_groups": 4}
    alg = cls(cls.Params(choice_on_device=True, **params), ctx)
    state = alg.init_state()
    for rnd in range(1, 11):
        state = alg.run_round(state, rnd, np.arange(fed.n_clients)).state
    assert adjusted_rand_score(np.arange(fed.n_clients) % 4, state.assign) >= 0.9


@pytest.mark.parametrize("cls", [DCFL, FedGroup])
def test_init_private_starts_from_the_private_starts_models(cls):
    """With ``init: private`` the K initial clusters are the private start's (the same
    models IFCA's ``init: private`` gets from the same clients, seed and context), and
    each cluster's first direction is its offset from their mean."""
    ctx, _ = _setup(cls)
    ifca_ctx, _ = _setup(cls)
    params = {"n_clusters": 2} if cls is DCFL else {"n_groups": 2}
    alg = cls(cls.Params(choice_on_device=True, init="private", **params), ctx)
    ifca = IFCA(IFCA.Params(n_clusters=2, init="private"), ifca_ctx)
    state, want = alg.init_state(), ifca.init_state()
    torch.testing.assert_close(state.models, want.models, rtol=0, atol=0)
    torch.testing.assert_close(state.directions, state.models - state.models.mean(0))
    assert not torch.equal(state.models[0], state.models[1])


def test_a_resumed_device_choice_under_central_dp_equals_the_uninterrupted_run(tmp_path):
    """The directions and their noise are server state: a checkpoint keeps them (and
    central DP its clip and ledger), so a run stopped after round 2 and resumed writes
    the uninterrupted run's metrics and clusters."""
    sets = [
        "data.dataset=digits",
        "data.partition={name: rotation, n_groups: 2, base: iid, "
        "base_options: {n_clients: 8, test_fraction: 0.2}}",
        "model.name=mclr",
        "model.options={}",
        "train={lr: 0.1, batch_size: 16, epochs: 1}",
        "privacy.mode=central",
        "privacy.count_noise=1.0",
        "checkpoint_every=1",
        "algorithms=[{name: dcfl, params: {n_clusters: 2, choice_on_device: true}}, "
        "{name: fedgroup, params: {n_groups: 2, choice_on_device: true}}]",
    ]
    config = resolve_config(None, "quickstart", sets, {"rounds": 3, "seeds": [0]})
    Experiment(config).run(tmp_path / "whole", progress=False)
    Experiment(config).run(tmp_path / "resumed", progress=False, stop_after_round=2)
    resume(tmp_path / "resumed", progress=False)
    for name in ("metrics.csv", "clusters.csv"):
        whole, resumed = (_rows(tmp_path / run / name) for run in ("whole", "resumed"))
        assert whole == resumed and len(whole) > 0, name


def _rows(path) -> list[dict[str, str]]:
    with path.open() as f:
        return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in csv.DictReader(f)]


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize(
    "name,params,field",
    [
        ("dcfl", {"choice_on_device": True, "preference": -1.0}, "preference"),
        ("dcfl", {"choice_on_device": True, "max_exact_participants": 50}, "max_exact"),
        ("dcfl", {"n_clusters": 3}, "n_clusters needs choice_on_device"),
        ("fedgroup", {"choice_on_device": True, "rcc": True}, "rcc"),
        ("fedgroup", {"choice_on_device": True, "measure": "madc"}, "measure"),
        ("fedgrouprox", {"choice_on_device": True, "eta_g": 0.1}, "eta_g"),
        ("dcfl", {"init": "private"}, "init: private needs choice_on_device"),
        ("fedgroup", {"init": "private"}, "init: private needs choice_on_device"),
    ],
)
def test_settings_the_device_choice_cannot_use_are_refused_in_one_line(name, params, field):
    with pytest.raises(ConfigError, match=field) as error:
        algorithm_params(AlgorithmSpec(name=name, params=params))
    assert "\n" not in str(error.value)
