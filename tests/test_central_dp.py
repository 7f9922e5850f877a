"""Central DP per cluster aggregate and privatised sketches (fedcluster.privacy.central).

Against hand computations (the sketch's clip and noise scale, Andrew et al.'s
noise split and clip update) and against Opacus' RDP accountant called
directly (the composed ε of aggregates and sketches).
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

import fedcluster.privacy.central as central_dp
from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.config.schema import resolve_config
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment
from fedcluster.privacy.central import (
    CentralDP,
    calibrate_central,
    composed_epsilon,
    projection,
    release_sketch,
    update_noise_multiplier,
)
from fedcluster.rng import torch_rng

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:opacus.*"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:opacus.*"),
]


def central(n: int, z: float = 2.0, count_noise: float = 5.0, clip: float = 0.5) -> CentralDP:
    return CentralDP(n, seed=3, delta=1e-5, noise_multiplier=z, count_noise=count_noise,
                     sample_rate=1.0, clip=clip)  # fmt: skip


# ------------------------------------------------------------------- sketch
def test_sketch_is_the_clipped_projection_plus_noise_of_std_z_times_c():
    d, k, clip, z = 300, 40, 0.7, 1.3
    matrix = projection(0, d, k)
    assert matrix.shape == (k, d)
    assert matrix.var().item() == pytest.approx(1.0 / k, rel=0.05)  # JL: E‖Pu‖² = ‖u‖²
    updates = torch.randn(3, d) * torch.tensor([[0.001], [1.0], [10.0]])
    gens = [torch_rng(0, "test", i) for i in range(3)]
    released = release_sketch(updates, matrix, clip, z, gens)
    # by hand: P·u, scaled down to norm C when longer, plus z·C times the generator's draws
    for i in range(3):
        projected = matrix @ updates[i]
        norm = projected.norm().item()
        clipped = projected * min(1.0, clip / norm)
        noise = torch.randn(k, generator=torch_rng(0, "test", i)) * (z * clip)
        torch.testing.assert_close(released[i], clipped + noise, rtol=1e-5, atol=1e-6)
    # sensitivity: without noise no sketch is longer than C (its neighbour sends nothing)
    silent = release_sketch(updates * 1e3, matrix, clip, 0.0, gens)
    assert silent.norm(dim=1).max().item() == pytest.approx(clip, rel=1e-5)
    # noise scale: zero updates release pure noise of std z·C
    many = release_sketch(
        torch.zeros(500, d), matrix, clip, z, [torch_rng(1, "n", i) for i in range(500)]
    )
    assert many.std().item() == pytest.approx(z * clip, rel=0.03)


def test_server_clusters_on_each_clients_mean_sketch_and_stops_at_its_releases():
    d, k = 50, 8
    dp = central(4)
    dp.sketch_matrix, dp.sketch_noise, dp.sketch_releases = projection(0, d, k), 0.0, 2
    dp.sketch_sum = torch.zeros(4, k)
    start, clients = torch.zeros(d), np.array([0, 2])
    update = torch.randn(2, d) * 0.01  # within the clip: the sketch is P·u
    for rnd in (1, 2, 3):
        dp.start_round(rnd)
        dp.observe(clients, start, start + update * rnd)
    # releases 1 and 2 only: mean of P·u and P·2u
    torch.testing.assert_close(dp.sketches(clients), 1.5 * update @ dp.sketch_matrix.T)
    assert dp.sketched.tolist() == [2, 0, 2, 0]
    assert dp.releases.tolist() == [3, 0, 3, 0]


# --------------------------------------------------------------- accountant
@pytest.mark.parametrize("q,aggregates,sketches", [(1.0, 20, 1), (1.0, 15, 3)])
def test_composed_epsilon_is_opacus_rdp_of_the_history(q, aggregates, sketches):
    z, z_s, _ = calibrate_central(10.0, 1e-5, q, aggregates, sketches, 0.5)
    acc = RDPAccountant()  # the independent computation: one step at a time
    for _ in range(aggregates):
        acc.step(noise_multiplier=z, sample_rate=q)
    for _ in range(sketches):
        acc.step(noise_multiplier=z_s, sample_rate=1.0)
    spent = acc.get_epsilon(delta=1e-5)
    assert composed_epsilon([(z, q, aggregates), (z_s, 1.0, sketches)], 1e-5) == pytest.approx(
        spent, rel=1e-9
    )
    assert 9.99 < spent <= 10.0  # calibrated to the target from below
    # the sketches' share of the precision A/z² + S/z_s² is the configured 0.5
    assert (sketches / z_s**2) / (aggregates / z**2) == pytest.approx(1.0, rel=1e-9)


def test_without_sketches_calibration_is_opacus_get_noise_multiplier():
    z, z_s, _ = calibrate_central(3.0, 1e-5, 1.0, 30)
    assert z_s == 0.0
    assert z == get_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sample_rate=1.0, steps=30, accountant="rdp"
    )


def test_ledger_epsilon_is_opacus_for_each_clients_releases():
    dp = central(3, z=1.5)
    dp.sketch_noise = 4.0
    dp.releases = np.array([0, 2, 5])
    dp.sketched = np.array([0, 1, 1])
    for c, eps in enumerate(dp.epsilons()):
        acc = RDPAccountant()
        acc.history = [(1.5, 1.0, int(dp.releases[c])), (4.0, 1.0, int(dp.sketched[c]))]
        expected = acc.get_epsilon(delta=1e-5) if dp.releases[c] else 0.0
        assert eps == pytest.approx(expected, rel=1e-9)


# ------------------------------------------------------ adaptive clipping
def test_noise_split_is_andrew_et_al_theorem_1():
    z, sigma_b = 1.2, 3.0
    z_delta = update_noise_multiplier(z, sigma_b)
    assert z_delta == pytest.approx((z**-2 - (2 * sigma_b) ** -2) ** -0.5)
    assert z_delta**-2 + (2 * sigma_b) ** -2 == pytest.approx(z**-2)  # one Gaussian of z
    with pytest.raises(ConfigError, match="count_noise"):
        update_noise_multiplier(2.0, 0.9)


def test_clip_follows_the_noisy_unclipped_fraction():
    dp = central(4, z=0.5, count_noise=0.5, clip=1.0)
    dp.start_round(7)
    start = torch.zeros(4, 10)
    rows = torch.zeros(4, 10)
    rows[:3, 0] = 0.5  # three updates under C = 1 ...
    rows[3, 0] = 2.0  # ... and one over it
    dp.observe(np.arange(4), start, rows)
    dp.end_round()
    noise = torch.randn(1, generator=torch_rng(3, "dp/central-count", 7)).item() * 0.5
    b = (3 + noise) / 4
    assert dp.clip == pytest.approx(math.exp(-0.2 * (b - 0.5)), rel=1e-6)


@pytest.mark.parametrize("q", [1.0, 0.25])
def test_under_sampling_every_round_is_a_step_of_every_clients_ledger(q):
    """Amplification by sampling prices a round over the chance of taking part: with
    q < 1 every client's ledger has one (z, q) step per round that released aggregates,
    selected or not (Opacus' RDPAccountant stepped once a round); with q = 1 only a
    client's own releases count."""
    dp = CentralDP(4, seed=3, delta=1e-5, noise_multiplier=1.2, count_noise=5.0,
                   sample_rate=q, clip=1.0)  # fmt: skip
    for rnd in (1, 2, 3):
        dp.start_round(rnd)
        rows = torch.ones(1, 6)  # only client 0 takes part
        dp.observe(np.array([0]), torch.zeros(6), rows)
        dp(torch.zeros(6), rows)
        dp.end_round()
    dp.start_round(4)  # a round without aggregates is no step
    dp.end_round()
    acc = RDPAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=1.2, sample_rate=q)
    eps = dp.epsilons()
    assert eps[0] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
    if q < 1.0:
        np.testing.assert_allclose(eps, eps[0], rtol=0)  # the others as much as client 0
    else:
        assert (eps[1:] == 0).all()  # under full participation, nothing without a release


def test_a_sampled_run_plans_every_round_and_ends_at_the_budget(tmp_path):
    """Under sampling the calibration plans a step per round even with a smaller
    ``max_participations`` (every round is a step of every ledger): the last round's ε is
    the target, never above it."""
    sets = [*TINY, "participation.fraction=0.25", "privacy.max_participations=expected",
            "algorithms=[{name: fedavg}]"]  # fmt: skip
    config = resolve_config(None, "quickstart", sets, {"rounds": 4, "seeds": [0]})
    Experiment(config).run(tmp_path, progress=False)
    with (tmp_path / "metrics.csv").open() as f:
        eps = [float(r["epsilon"]) for r in csv.DictReader(f)]
    assert eps == sorted(eps) and len(set(eps)) == 4  # a step every round
    assert 9.99 < eps[-1] <= 10.0


# ------------------------------------------------- noise once per aggregate
def test_central_noise_is_added_once_per_cluster_aggregate(monkeypatch):
    calls: list[float] = []
    draw = central_dp.gaussian_noise

    def counted(shape, std, generator):
        calls.append(std)
        return draw(shape, std, generator)

    monkeypatch.setattr(central_dp, "gaussian_noise", counted)
    n, d = 9, 40_000
    dp = central(n, z=2.0, count_noise=5.0, clip=0.5)
    dp.start_round(1)
    start = torch.randn(n, d)
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    out = cluster_average(start.clone(), labels, torch.zeros(3, d), aggregate=dp, start=start)
    assert len(calls) == 3  # one draw per cluster, none per client
    z_delta = update_noise_multiplier(2.0, 5.0)
    assert calls == [pytest.approx(z_delta * 0.5)] * 3
    for k in range(3):  # zero updates: the cluster's mean start plus noise / n_k
        members = torch.as_tensor(labels == k)
        noise = (out[k] - start[members].mean(dim=0)) * int(members.sum())
        assert noise.std().item() == pytest.approx(z_delta * 0.5, rel=0.03)


# ------------------------------------------------------------------ a run
TINY = [
    "data.dataset=digits",
    "data.partition={name: rotation, n_groups: 2, base: iid, "
    "base_options: {n_clients: 8, test_fraction: 0.2}}",
    "model.options={hidden: [16]}",
    "train={lr: 0.1, batch_size: 16, epochs: 1}",
    "privacy.mode=central",
    "privacy.count_noise=1.0",
]


def test_central_run_reports_the_calibrated_epsilon(tmp_path):
    sets = [*TINY, "privacy.sketch_dim=16", "algorithms=[{name: dcfl}, {name: fedavg}]"]
    config = resolve_config(None, "quickstart", sets, {"rounds": 3, "seeds": [0]})
    Experiment(config).run(tmp_path, progress=False)
    with (tmp_path / "metrics.csv").open() as f:
        last = [r for r in csv.DictReader(f) if r["round"] == "3"]
    for row in last:  # every round every client released: the whole budget, ε ≤ target
        assert 9.99 < float(row["epsilon"]) <= 10.0


@pytest.mark.parametrize(
    "algorithm,extra,error",
    [
        ("dcfl", [], "sketch_dim"),
        ("cfl", [], "not available"),
        ("fedavg", ["privacy.accountant=prv"], "rdp"),
    ],
)
def test_what_central_dp_cannot_account_is_refused(tmp_path, algorithm, extra, error):
    sets = [*TINY, *extra, f"algorithms=[{{name: {algorithm}}}]"]
    config = resolve_config(None, "quickstart", sets, {"rounds": 1})
    with pytest.raises(ConfigError, match=error):
        Experiment(config).run(tmp_path, progress=False)


def test_a_choice_on_the_device_counts_every_release_as_the_server_choice_does(tmp_path):
    """IFCA's, JGL's (eq. 4 from the released models and steps), FeSEM's (its E-step
    against the released centres), DCFL's (eq. 6) and FedGroup's (eq. 9, both against the
    released cluster steps, without sketches) choices on the device run under central DP; every
    accepted upload of theirs is one aggregate release, so each job spends the budget
    FedAvg spends over the same rounds (ε just under 10)."""
    algorithms = (
        "algorithms=[{name: fedavg}, {name: ifca, params: {n_clusters: 2}}, "
        "{name: ifca, label: ifca-device, params: {n_clusters: 2, choice_on_device: true}}, "
        "{name: jgl, params: {n_clusters: 2, choice_on_device: true}}, "
        "{name: fesem, params: {n_clusters: 2, init: random, choice_on_device: true}}, "
        "{name: dcfl, params: {n_clusters: 2, choice_on_device: true}}, "
        "{name: fedgroup, params: {n_groups: 2, choice_on_device: true}}]"
    )
    config = resolve_config(None, "quickstart", [*TINY, algorithms], {"rounds": 3, "seeds": [0]})
    Experiment(config).run(tmp_path, progress=False)
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    for rnd in ("1", "2", "3"):
        eps = {r["algorithm"]: float(r["epsilon"]) for r in rows if r["round"] == rnd}
        assert len(eps) == 7 and len(set(eps.values())) == 1, eps
    assert 9.99 < eps["fedavg"] <= 10.0


def test_jgl_choosing_on_the_server_is_refused_under_central_dp(tmp_path):
    sets = [*TINY, "algorithms=[{name: jgl, params: {n_clusters: 2}}]"]
    config = resolve_config(None, "quickstart", sets, {"rounds": 1})
    with pytest.raises(
        ConfigError, match="JGL, FeSEM, DCFL or FedGroup with choice_on_device: true"
    ):
        Experiment(config).run(tmp_path, progress=False)
