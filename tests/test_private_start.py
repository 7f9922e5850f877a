"""The private start (fedcluster.privacy.private_start): DP clustering of first updates.

Against hand computations (Analyze Gauss's noisy matrix and numpy's eigh, one
DP-Lloyd iteration with the same generator), noise-free recovery of hand-made
blobs, Opacus' RDP accountant for the composed ε, and determinism of a run.
"""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from sklearn.metrics import adjusted_rand_score

from fedcluster.algorithms.base import init_row
from fedcluster.config.schema import PrivacyConfig, resolve_config
from fedcluster.data.configured import build_federation_for
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment, model_for
from fedcluster.privacy.central import calibrate_central, composed_epsilon
from fedcluster.privacy.mechanisms import clip_rows
from fedcluster.privacy.private_start import (
    PrivateStart,
    UpdateStatistics,
    basis_from,
    lloyd_from,
    nearest,
    private_start,
    start_releases,
)
from fedcluster.rng import torch_rng
from tests.helpers import FLOAT_BYTES
from tests.test_central_dp import TINY

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:opacus.*"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:opacus.*"),
]


def test_analyze_gauss_releases_the_top_eigenvectors_of_the_noisy_second_moment():
    n, k, r, clip, z = 40, 6, 3, 0.8, 1.5
    sketches = clip_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), clip)
    stats = UpdateStatistics(sketches, torch.eye(k), clip)  # P = I: the sketches themselves
    basis = basis_from(stats.second_moment(), clip, z, torch_rng(1, "pca"), r)
    # by hand: the same draws, upper triangle (with the diagonal) of std z·C², mirrored
    draws = torch.randn(k, k, generator=torch_rng(1, "pca")).double().numpy() * z * clip**2
    upper = np.triu(draws)
    s = sketches.double().numpy()
    noisy = s.T @ s + upper + np.triu(upper, 1).T
    values, vectors = np.linalg.eigh(noisy)
    expected = vectors[:, ::-1][:, :r]
    assert basis.shape == (k, r)
    assert values[-r - 1] < values[-r]  # a gap: the top r directions are unique up to sign
    # eigenvectors agree up to sign; float32 release of float64 vectors of norm 1
    overlap = np.abs(basis.double().numpy().T @ expected)
    np.testing.assert_allclose(overlap, np.eye(r), atol=1e-5)


def test_one_dp_lloyd_iteration_is_the_hand_computation():
    clip, z = 0.5, 2.0
    coords = clip_rows(torch.randn(30, 3, generator=torch.Generator().manual_seed(2)), clip)
    centres = torch.tensor([[0.3, 0.0, 0.0], [-0.3, 0.0, 0.0], [0.0, 0.3, 0.0]])
    stats, basis = UpdateStatistics(coords, torch.eye(3), clip), torch.eye(3)
    new = lloyd_from(stats.cluster_sums(basis, centres), centres, clip, z, torch_rng(0, "lloyd"))
    assign = nearest(coords, centres)
    draws = torch.randn(3, 4, generator=torch_rng(0, "lloyd")) * (z * clip * 2**0.5)
    for i, point in enumerate(coords):  # each client takes its nearest centre
        distances = [float((point - c).norm()) for c in centres]
        assert assign[i] == int(np.argmin(distances))
    for c in range(3):
        members = coords[torch.as_tensor(assign == c)]
        count = (clip * len(members) + draws[c, 3].item()) / clip
        expected = (members.sum(dim=0) + draws[c, :3]) / count if count >= 1.0 else centres[c]
        torch.testing.assert_close(new[c], expected, rtol=1e-5, atol=1e-6)


def blobs() -> tuple[torch.Tensor, np.ndarray]:
    """Four tight groups of unequal sizes around 0.5·e_j in 8 dimensions."""
    sizes = [10, 20, 30, 40]
    groups = np.repeat(np.arange(4), sizes)
    centres = 0.5 * torch.eye(8)[:4]
    jitter = 0.01 * torch.randn(len(groups), 8, generator=torch.Generator().manual_seed(3))
    return centres[torch.as_tensor(groups)] + jitter, groups


def test_without_noise_the_start_recovers_separated_blobs_and_their_mean_updates():
    updates, groups = blobs()
    params = PrivateStart(seed_dims=4, grid=5)
    stats = UpdateStatistics(updates, torch.eye(8), 1.0)
    found = private_start(stats, 4, params, 1.0, 0.0, seed=0)
    assign = nearest(stats.coordinates(found.basis), found.centres)
    assert adjusted_rand_score(groups, assign) == 1.0
    assert sorted(found.sizes.tolist()) == [10, 20, 30, 40]
    for g in range(4):  # each found group's model step is its members' mean update
        members = assign == assign[groups == g][0]
        torch.testing.assert_close(
            found.updates[assign[groups == g][0]],
            updates[torch.as_tensor(members)].mean(dim=0),
            rtol=1e-5,
            atol=1e-6,
        )


def test_the_start_is_deterministic_in_its_seed():
    updates, _ = blobs()
    params = PrivateStart(seed_dims=4, grid=5)
    stats = UpdateStatistics(updates, torch.eye(8), 1.0)
    first = private_start(stats, 4, params, 1.0, 0.7, seed=5)
    again = private_start(stats, 4, params, 1.0, 0.7, seed=5)
    other = private_start(stats, 4, params, 1.0, 0.7, seed=6)
    assert torch.equal(first.updates, again.updates)
    assert np.array_equal(first.sizes, again.sizes)
    assert not torch.equal(first.updates, other.updates)


def test_composed_epsilon_of_training_and_start_is_opacus_rdp():
    q, aggregates, starts = 0.5, 12, start_releases(5)
    z, z_s, z_r = calibrate_central(8.0, 1e-5, q, aggregates, 0, 0.5, starts, 0.25)
    assert z_s == 0.0
    acc = RDPAccountant()  # the independent computation: one step at a time
    for _ in range(aggregates):
        acc.step(noise_multiplier=z, sample_rate=q)
    for _ in range(starts):
        acc.step(noise_multiplier=z_r, sample_rate=1.0)
    spent = acc.get_epsilon(delta=1e-5)
    history = [(z, q, aggregates), (z_r, 1.0, starts)]
    assert composed_epsilon(history, 1e-5) == pytest.approx(spent, rel=1e-9)
    assert 7.99 < spent <= 8.0
    # the start's share of the precision A/z² + R/z_r² is the configured 0.25
    assert (starts / z_r**2) / (aggregates / z**2) == pytest.approx(0.25 / 0.75, rel=1e-9)


def private_start_algorithms(extra: str = "") -> str:
    start = f"init: private, private_start: {{sketch_dim: 8, iterations: 2{extra}}}"
    return (
        f"algorithms=[{{name: ifca, params: {{n_clusters: 2, {start}}}}}, "
        f"{{name: fesem, params: {{n_clusters: 2, choice_on_device: true, {start}}}}}, "
        f"{{name: jgl, params: {{n_clusters: 2, choice_on_device: true, {start}}}}}]"
    )


def private_ifca(extra: str = "") -> list[str]:
    return [*TINY, private_start_algorithms(extra)]


def run_metrics(tmp_path, sets: list[str], rounds: int) -> list[dict[str, str]]:
    config = resolve_config(None, "quickstart", sets, {"rounds": rounds, "seeds": [0]})
    Experiment(config).run(tmp_path, progress=False)
    with (tmp_path / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_a_private_start_run_reports_the_composed_epsilon_and_repeats(tmp_path):
    """Every client enters the start's T + 3 releases before round 1 and one aggregate per
    round, whether IFCA's loss, FeSEM's E-step or JGL's eq. 4 on the device chooses; the
    epsilon column is their RDP composition, and the calibrated budget is spent (just
    under ε = 10) by the last round. The same seed gives the same numbers."""
    rows = run_metrics(tmp_path / "a", private_ifca(), 2)
    again = run_metrics(tmp_path / "b", private_ifca(), 2)
    share = PrivacyConfig().start_share
    z, _, z_r = calibrate_central(10.0, 1e-5, 1.0, 2, 0, 0.5, start_releases(2), share)
    assert {r["algorithm"] for r in rows} == {"ifca", "fesem", "jgl"}
    for row in rows:
        history = [(z, 1.0, int(row["round"])), (z_r, 1.0, start_releases(2))]
        assert float(row["epsilon"]) == pytest.approx(composed_epsilon(history, 1e-5), rel=1e-9)
    assert all(9.99 < float(r["epsilon"]) <= 10.0 for r in rows if r["round"] == "2")
    keys = ("algorithm", "accuracy", "epsilon", "bytes_up")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in again]


def test_without_dp_the_start_is_one_counted_training_upload_per_client(tmp_path):
    """Without DP the same pipeline runs noise-free; the start's training exchange is
    traffic of round 1: one model row up per client more than a random start's round."""
    plain = [s for s in TINY if not s.startswith("privacy.")]
    algorithms = (
        "algorithms=[{name: ifca, label: random, params: {n_clusters: 2}}, "
        "{name: ifca, label: private, params: {n_clusters: 2, init: private}}]"
    )
    rows = run_metrics(tmp_path, [*plain, algorithms], 1)
    up = {r["algorithm"]: int(r["bytes_up"]) for r in rows}
    config = resolve_config(None, "quickstart", [*plain, algorithms], {"rounds": 1})
    federation = build_federation_for(config, 0)
    dim = init_row(model_for(config, federation), 0, "init").numel()
    assert up["private"] - up["random"] == federation.n_clients * dim * FLOAT_BYTES
    assert all(r["epsilon"] == "" for r in rows)  # no DP: no ε


@pytest.mark.parametrize("init", ["private", "same"])
def test_the_good_initializer_with_a_start_that_is_not_random_is_refused(init):
    """``min_cluster_share`` re-draws random models: with another start it would be ignored."""
    ifca = f"algorithms=[{{name: ifca, params: {{init: {init}, min_cluster_share: 0.2}}}}]"
    config = resolve_config(None, "quickstart", [*TINY, ifca], {"rounds": 1})
    with pytest.raises(ConfigError, match=f"min_cluster_share.*init: {init}"):
        Experiment(config)


def test_too_many_histogram_cells_are_one_line_naming_the_field(tmp_path):
    sets = private_ifca(", grid: 200, seed_dims: 3")
    with pytest.raises(ConfigError, match="private_start.grid"):
        run_metrics(tmp_path, sets, 1)


def test_a_start_and_sketches_that_leave_the_aggregates_no_budget_are_refused(tmp_path):
    sets = [*private_ifca(), "privacy.sketch_dim=8", "privacy.sketch_share=0.6"]
    with pytest.raises(ConfigError, match="privacy.start_share"):
        run_metrics(tmp_path, sets, 1)
