"""The criterion of ``n_clusters: auto`` (fedcluster.clustering.select_k) against scikit-learn
and Rousseeuw's silhouette computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.metrics import silhouette_score

from fedcluster.clustering.select_k import choose_k, silhouette_curve
from fedcluster.errors import ConfigError, FedclusterError


def three_groups(seed: int = 0, per_group: int = 6, dim: int = 40) -> np.ndarray:
    """Update vectors of 3 groups: each a random direction (random length) plus small noise."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, dim))
    rows = [
        c * rng.uniform(0.5, 2.0) + 0.15 * rng.normal(size=dim)
        for c in centres
        for _ in range(per_group)
    ]
    return np.array(rows)


def hand_silhouette(x: np.ndarray, labels: np.ndarray) -> float:
    """Rousseeuw (1987): s(i) = (b − a) / max(a, b), a the mean distance within i's
    cluster, b the least mean distance to another cluster; 0 for a singleton."""
    d = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
    s = []
    for i in range(len(x)):
        own = labels == labels[i]
        if own.sum() == 1:
            s.append(0.0)
            continue
        a = d[i, own].sum() / (own.sum() - 1)
        b = min(d[i, labels == c].mean() for c in set(labels.tolist()) - {labels[i]})
        s.append((b - a) / max(a, b))
    return float(np.mean(s))


def test_three_well_separated_groups_give_k_3_as_sklearn_scores_them():
    seed = 7
    x = three_groups(seed)
    curve = silhouette_curve(x, (2, 5), random_state=seed)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    for k, value in curve.items():  # scikit-learn's k-means and silhouette, called directly
        labels = KMeans(k, init="k-means++", n_init=10, random_state=seed).fit_predict(unit)
        assert value == pytest.approx(silhouette_score(unit, labels), abs=1e-12)
        assert value == pytest.approx(hand_silhouette(unit, labels), abs=1e-9)
    assert choose_k(curve) == 3
    assert max(curve, key=curve.get) == 3


def test_rows_are_compared_by_direction_not_length():
    x = three_groups()
    scaled = x * np.random.default_rng(5).uniform(0.1, 10.0, size=(len(x), 1))
    assert silhouette_curve(scaled, (2, 4)) == pytest.approx(silhouette_curve(x, (2, 4)))


def test_ties_go_to_the_smaller_k_and_nan_is_skipped():
    assert choose_k({2: 0.5, 3: 0.7, 4: 0.7, 5: math.nan}) == 3
    with pytest.raises(FedclusterError, match="identical"):
        choose_k({2: math.nan, 3: math.nan})


@pytest.mark.filterwarnings("ignore:Number of distinct clusters")
def test_identical_rows_have_no_silhouette():
    curve = silhouette_curve(np.ones((5, 3)), (2, 3))
    assert all(math.isnan(v) for v in curve.values())


@pytest.mark.parametrize("k_range", [(1, 3), (3, 2), (2, 6)])
def test_a_range_the_silhouette_cannot_score_is_one_line(k_range):
    with pytest.raises(ConfigError, match="k_range") as err:
        silhouette_curve(three_groups(per_group=2), k_range)  # 6 rows: K <= 5
    assert "\n" not in str(err.value)
