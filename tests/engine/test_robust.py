"""Robust aggregation (Yin et al. ICML 2018; norm clipping) and the faults that call for it.

The rules are checked against independent computations (numpy's median,
scipy's trimmed mean, a hand-made clipping in float64); the wiring against
every algorithm that averages models (each must aggregate through
``Context.aggregate``), and the new faults against their definitions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from fedcluster.algorithms import ALGORITHMS
from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.algorithms.robust import (
    Aggregator,
    aggregate,
    aligned_mean,
    clipped_mean,
    coordinate_median,
    copies,
    guarded_mean,
    krum_scores,
    multi_krum,
    trimmed_mean,
)
from fedcluster.config.schema import ConfigError, resolve_config
from fedcluster.engine.flat import weighted_average
from fedcluster.experiment.scenario import FAULTS, FaultyUploads, alie_z, flip_labels
from tests.algorithms.test_rejection import PARAMS
from tests.helpers import make_context, rotated_digits


def _rows(n: int, d: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(seed).normal(size=(n, d)))


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_median_is_numpy_median_per_coordinate(n):
    rows = _rows(n)
    weights = torch.arange(1.0, n + 1)  # ignored: one client, one vote
    got = coordinate_median(rows[0], rows, weights)
    np.testing.assert_array_equal(got.numpy(), np.median(rows.numpy(), axis=0))


@pytest.mark.parametrize(("n", "trim"), [(10, 0.1), (10, 0.25), (7, 0.2), (4, 0.1), (9, 0.4)])
def test_trimmed_mean_equals_scipy_with_equal_weights(n, trim):
    rows = _rows(n, seed=n)
    got = trimmed_mean(rows[0], rows, torch.ones(n), trim)
    want = stats.trim_mean(rows.numpy(), trim, axis=0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_trimmed_mean_keeps_each_values_weight():
    # One coordinate, trim 1 of 4 per side: 1 and 100 go, 2 (weight 1) and 3 (weight 3) stay.
    rows = torch.tensor([[3.0], [100.0], [1.0], [2.0]], dtype=torch.float64)
    weights = torch.tensor([3.0, 5.0, 7.0, 1.0])
    got = trimmed_mean(rows[0], rows, weights, 0.25)
    assert got.item() == pytest.approx((3 * 3.0 + 1 * 2.0) / 4)


def test_clipping_leaves_updates_below_the_scale_untouched():
    start = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    directions = _rows(5, d=3, seed=3)
    directions = directions / directions.norm(dim=1, keepdim=True)
    norms = np.array([1.0, 2.0, 3.0, 4.0, 50.0])
    updates = directions * torch.as_tensor(norms).unsqueeze(1)
    weights = torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0])
    got = clipped_mean(start, start + updates, weights, quantile=0.5)
    # Hand computation: the median norm is 3; the first three pass, the others shrink to norm 3.
    clipped = updates.numpy() * np.minimum(1.0, 3.0 / norms)[:, None]
    want = start.numpy() + (weights.numpy()[:, None] * clipped).sum(0) / weights.numpy().sum()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    assert np.allclose(clipped[:3], updates.numpy()[:3])


def test_clipping_measures_updates_from_each_rows_start():
    starts = _rows(4, d=3, seed=5)
    updates = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 9]], dtype=torch.float64)
    got = clipped_mean(starts, starts + updates, torch.ones(4), quantile=0.5)
    want = (starts + updates * torch.tensor([1.0, 1, 1, 1 / 9]).unsqueeze(1)).mean(0)
    torch.testing.assert_close(got, want)


def test_mean_rule_is_the_plain_weighted_average_bit_for_bit():
    rows = _rows(6).float()
    weights = torch.tensor([5, 1, 2, 8, 3, 4])
    assert torch.equal(aggregate(rows[0], rows, weights), weighted_average(rows, weights))
    assert torch.equal(Aggregator()(rows[0], rows, None), weighted_average(rows, torch.ones(6)))


def test_cluster_average_applies_the_rule_per_cluster():
    rows = _rows(7)
    labels = np.array([0, 1, 0, 1, 0, 1, 1])
    previous = torch.zeros(3, rows.shape[1], dtype=rows.dtype)
    out = cluster_average(rows, labels, previous, aggregate=Aggregator("median"))
    for c in (0, 1):
        np.testing.assert_array_equal(out[c].numpy(), np.median(rows[labels == c].numpy(), axis=0))
    assert torch.equal(out[2], previous[2])  # no members: unchanged


def test_a_scaled_minority_cannot_move_the_robust_average():
    """25% of updates ×10 (finite, plausible): the plain mean moves, the robust rules barely."""
    rng = np.random.default_rng(1)
    honest = torch.as_tensor(1.0 + 0.1 * rng.normal(size=(12, 50)))  # updates near (1, ..., 1)
    rows = honest.clone()
    rows[:3] *= 10.0
    start = torch.zeros(50, dtype=rows.dtype)
    truth = honest.mean(0)
    plain = aggregate(start, rows, None)
    assert (plain - truth).norm() > 2.0 * truth.norm()
    for rule in ("median", "trimmed_mean", "clipped_mean"):
        robust = aggregate(start, rows, None, Aggregator(rule, trim=0.25))
        assert (robust - truth).norm() < 0.1 * truth.norm(), rule


def test_config_section_and_unknown_rule():
    cfg = resolve_config(None, "quickstart", ["aggregation.rule=clipped_mean"], {})
    assert Aggregator(**cfg.aggregation.model_dump()) == Aggregator("clipped_mean", 0.1, 0.5)
    default = resolve_config(None, "quickstart", [], {}).aggregation
    assert Aggregator(**default.model_dump()) == Aggregator()
    with pytest.raises(ConfigError, match="aggregation.rule"):
        resolve_config(None, "quickstart", ["aggregation.rule=mode"], {})


@pytest.fixture(scope="module")
def federation():
    return rotated_digits(n_groups=2, clients_per_group=4, per_client=40)


class Spy:
    """An aggregator that records its calls and delegates to the median rule."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, start, rows, weights=None):
        self.calls += 1
        return aggregate(start, rows, weights, Aggregator("median"))


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_every_averaging_algorithm_aggregates_through_the_context(federation, name):
    cls = ALGORITHMS[name]
    ctx = make_context(federation, hidden=[16])
    ctx.aggregate = Spy()
    alg = cls(cls.Params(**PARAMS[name]), ctx)
    state = alg.init_state()
    for rnd in (1, 2, 3):
        state = alg.run_round(state, rnd, np.arange(8)).state
    assert ctx.aggregate.calls > 0
    rows, _ = alg.eval_rows(state)
    assert torch.isfinite(rows).all()


def test_scaled_and_sign_flipped_uploads():
    start = torch.tensor([[1.0, 1.0]] * 4)
    trained = torch.tensor([[2.0, 0.0], [3.0, 1.0], [1.0, 5.0], [0.0, 0.0]])
    fault = np.array([-1, FAULTS.index("scaled"), FAULTS.index("sign_flip"), FAULTS.index("huge")])
    out = FaultyUploads(fault, scale=100.0, scaled_factor=10.0, flip_factor=5.0)(
        np.arange(4), start, trained, 1
    )
    want = torch.tensor([[2.0, 0.0], [21.0, 1.0], [1.0, -19.0], [-99.0, -99.0]])
    assert torch.equal(out, want)


def test_the_quartile_scale_survives_a_majority_of_huge_updates():
    """60% of updates ×1e6: the median norm is theirs, the lower quartile still an honest one."""
    rng = np.random.default_rng(2)
    honest = torch.as_tensor(1.0 + 0.1 * rng.normal(size=(10, 50)))
    rows = torch.cat([honest, 1e6 * torch.as_tensor(1.0 + 0.1 * rng.normal(size=(15, 50)))])
    start = torch.zeros(50, dtype=rows.dtype)
    truth = honest.mean(0)
    quartile = aggregate(start, rows, None, Aggregator("clipped_mean", clip_quantile=0.25))
    assert (quartile - truth).norm() < 0.1 * truth.norm()
    median_scale = aggregate(start, rows, None, Aggregator("clipped_mean", clip_quantile=0.5))
    assert (median_scale - truth).norm() > 1e3 * truth.norm()


def test_clip_scale_comes_from_the_rounds_norms_not_the_clusters():
    """A boosted client alone in its cluster: its own norm is no scale; the round's
    median (the channel's record of every accepted update) clips it to an honest one."""
    start = torch.zeros(3, dtype=torch.float64)
    boosted = torch.tensor([[30.0, 40.0, 0.0]], dtype=torch.float64)  # norm 50
    round_norms = [5.0, 5.2, 5.1, 4.9, 50.0]
    alone = aggregate(start, boosted, None, Aggregator("clipped_mean"))
    assert torch.equal(alone, boosted[0])  # its own median is itself: nothing clipped
    tau = float(np.quantile(round_norms, 0.5, method="lower"))  # 5.1
    scaled = aggregate(
        start, boosted, None, Aggregator("clipped_mean", round_norms=lambda: round_norms)
    )
    assert torch.allclose(scaled, boosted[0] * (tau / 50.0), rtol=1e-12)


def test_aligned_mean_drops_sign_flipped_updates():
    """Three honest updates and one flipped copy: the flipped one points against the
    coordinate median and is left out; the rest is clipped_mean's arithmetic, by hand."""
    start = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    honest = torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.2, 1.8, 0.4, 0.1], [0.9, 2.1, 0.6, -0.1]])
    updates = torch.cat([honest, -honest[:1]]).double()
    weights = torch.tensor([10.0, 20.0, 30.0, 40.0])
    got = aligned_mean(start, start + updates, weights, quantile=0.25)
    norms = updates.norm(dim=1)
    tau = norms.sort().values[0]  # lower quartile of 4 norms: the smallest
    clipped = updates * torch.clamp(tau / norms, max=1.0).unsqueeze(1)
    w = weights[:3].double()
    want = start + (clipped[:3] * w.unsqueeze(1)).sum(0) / w.sum()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    # without a flipped update it is clipped_mean exactly
    assert torch.equal(
        aligned_mean(start, start + honest.double(), weights[:3]),
        clipped_mean(start, start + honest.double(), weights[:3]),
    )


def test_aligned_mean_keeps_everyone_when_the_median_has_no_direction():
    """Two opposite updates: their median is 0, no cosine is positive, all are kept."""
    start = torch.zeros(2, dtype=torch.float64)
    rows = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
    got = aligned_mean(start, rows, torch.ones(2))
    assert torch.equal(got, clipped_mean(start, rows, torch.ones(2)))


def test_the_channel_records_the_rounds_accepted_update_norms():
    ctx = make_context(rotated_digits(n_groups=2, clients_per_group=2))
    ctx.channel.start_round()
    clients = np.arange(4)
    updates = torch.tensor([[3.0, 4.0], [0.0, 1.0], [float("nan"), 0.0], [6.0, 8.0]])
    finite = np.array([True, True, False, True])
    keep = ctx.channel.accept_bounded(clients, updates, torch.zeros_like(updates), finite, rnd=1)
    assert keep.tolist() == [True, True, False, True]
    assert ctx.channel.update_norms == pytest.approx([5.0, 1.0, 10.0])
    ctx.channel.start_round()
    assert ctx.channel.update_norms == []


def test_krum_scores_by_hand():
    """Four updates on a line, 0, 1, 3, 10: squared distances summed over the
    n − f − 2 nearest (Blanchard et al. 2017), worked out by hand."""
    updates = torch.tensor([[0.0], [1.0], [3.0], [10.0]], dtype=torch.float64)
    # f = 0: two neighbours each. 0: 1 + 9; 1: 1 + 4; 3: 4 + 9; 10: 49 + 81
    assert krum_scores(updates, 0).tolist() == [10.0, 5.0, 13.0, 130.0]
    # f = 1: n − f − 2 = 1 neighbour: the nearest one's squared distance
    assert krum_scores(updates, 1).tolist() == [1.0, 1.0, 4.0, 49.0]


def test_multi_krum_averages_the_n_minus_f_best_scored_rows():
    start = torch.tensor([1.0, 1.0], dtype=torch.float64)
    updates = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [10.0, 0.0]], dtype=torch.float64)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # f = ⌊0.25·4⌋ = 1: scores 1, 1, 4, 49 (above); the three best are averaged with their weights
    got = multi_krum(start, start + updates, weights, byzantine=0.25)
    want = start + torch.tensor([(0 * 1 + 1 * 2 + 3 * 3) / 6, 0.0], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12)
    via_rule = aggregate(start, start + updates, weights, Aggregator("multi_krum"))
    assert torch.equal(via_rule, got)
    # f = 0 (too few rows for a share to round to one): the plain weighted mean
    assert torch.equal(
        multi_krum(start, start + updates[:3], weights[:3]),
        weighted_average(start + updates[:3], weights[:3]),
    )


def test_alie_z_is_baruch_et_als_formula():
    """z_max = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − m (Baruch et al., NeurIPS 2019), via scipy."""
    for n, m in ((24, 6), (50, 12), (20, 2), (10, 4)):
        s = n // 2 + 1 - m
        assert alie_z(n, m) == pytest.approx(stats.norm.ppf((n - s) / n), rel=1e-9)
    assert alie_z(24, 6) == pytest.approx(0.5485, abs=1e-4)
    assert alie_z(4, 4) == pytest.approx(stats.norm.ppf(3 / 4))  # a majority: s taken as 1


def test_alie_attackers_send_the_honest_mean_minus_z_std():
    """Two colluders among four: each sends its own start + μ − z·σ of the two sound
    updates (hand-computed: μ = (1, 2), sample σ = (√2, 0)); others pass unchanged."""
    alie, flip = FAULTS.index("alie"), FAULTS.index("label_flip")
    fault = np.array([-1, alie, -1, alie, flip])
    start = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 1.0], [2.0, 0.0], [5.0, 5.0]])
    trained = torch.tensor([[0.0, 2.0], [7.0, 7.0], [2.0, 3.0], [9.0, 9.0], [6.0, 6.0]])
    out = FaultyUploads(fault, scale=100.0, z=0.5)(np.arange(5), start, trained, 1)
    sent = torch.tensor([1.0 - 0.5 * 2**0.5, 2.0])
    assert torch.allclose(out[1], start[1] + sent) and torch.allclose(out[3], start[3] + sent)
    assert torch.equal(out[[0, 2, 4]], trained[[0, 2, 4]])  # label flippers upload as trained
    paper = FaultyUploads(fault, scale=100.0)(np.arange(5), start, trained, 1)
    want = start[1] + torch.tensor([1.0 - alie_z(5, 2) * 2**0.5, 2.0])
    assert torch.allclose(paper[1], want)


def test_label_flippers_train_on_flipped_labels_only():
    fed = rotated_digits(n_groups=2, clients_per_group=2, per_client=10)
    flipped = flip_labels(fed, np.array([1, 3]))
    for c in range(4):
        part = fed.client_slice(c)
        want = 9 - fed.y_train[part] if c in (1, 3) else fed.y_train[part]
        assert torch.equal(flipped.y_train[part], want)
    assert flipped.x_train is fed.x_train and torch.equal(flipped.y_test, fed.y_test)
    assert fed.n_classes == 10


def test_copies_are_updates_with_a_twin_direction():
    updates = torch.tensor([[1.0, 0.0], [2.0, 1e-4], [0.0, 1.0], [0.1, 1.0], [0.0, -1.0]])
    assert copies(updates).tolist() == [True, True, False, False, False]


def test_aligned_mean_ignores_colluding_copies_that_would_make_the_reference():
    """Three copies of (−1, 0.2) and two honest updates: all five's coordinate median is
    (−1, 0.2), against which both honest updates point away; without the copies the
    median is (0.75, 0.75) and the honest updates are what remains (quantile 1: no clip)."""
    start = torch.tensor([2.0, -1.0], dtype=torch.float64)
    updates = torch.tensor([[-1.0, 0.2]] * 3 + [[1.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    got = aligned_mean(start, start + updates, torch.ones(5), quantile=1.0)
    assert torch.allclose(got, start + torch.tensor([0.75, 0.75], dtype=torch.float64))


def _guarded_case() -> tuple[torch.Tensor, torch.Tensor]:
    # no two parallel (parallel updates would be copies)
    honest = [[1.0, 0.0], [1.1, 0.1], [0.9, -0.1], [1.0, 0.2], [1.0, -0.2], [1.05, 0.05]]
    return torch.tensor(honest, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)


def test_guarded_mean_spends_what_aligned_leaves_of_the_budget_on_krum():
    """n = 8, f = ⌊0.25·8⌋ = 2: the flipped update is left out by direction (median (1, .025)),
    the remaining exclusion goes to the far update (4, 0.5) by Krum's score; the six
    honest updates are averaged (quantile 1: nothing clipped)."""
    honest, start = _guarded_case()
    far, flipped = torch.tensor([[4.0, 0.5]]), torch.tensor([[-1.0, 0.0]])
    rows = torch.cat([honest, far.double(), flipped.double()])
    got = guarded_mean(start, rows, torch.ones(8), quantile=1.0, byzantine=0.25)
    want = torch.tensor([6.05 / 6, 0.05 / 6], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12)
    # aligned_mean alone keeps the far update
    kept7 = torch.cat([honest, far.double()]).mean(0)
    assert torch.allclose(aligned_mean(start, rows, torch.ones(8), quantile=1.0), kept7)


def test_guarded_mean_counts_left_out_copies_against_the_budget():
    """Two copies and the far update: the copies use up f = 2, the far update stays."""
    honest, start = _guarded_case()
    rows = torch.cat([honest, torch.tensor([[4.0, 0.5], [0.3, 0.3], [0.3, 0.3]]).double()])
    got = guarded_mean(start, rows, torch.ones(9), quantile=1.0, byzantine=0.25)
    assert torch.allclose(got, torch.cat([honest, rows[6:7]]).mean(0), rtol=1e-12)
