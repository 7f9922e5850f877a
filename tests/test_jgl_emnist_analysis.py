"""benchmarks/reproduction/jgl_emnist.py's measurements against hand computations
(docs/reproduction.md, "JGL's EMNIST setting"): the clusters' label overlap and repair's
test on a cosine matrix."""

from __future__ import annotations

import numpy as np

from benchmarks.reproduction.jgl_emnist import _split_separations, label_overlap


def test_label_overlap_by_hand() -> None:
    # cluster 0: classes 0,1 (1:1); cluster 1: classes 1,2 (1:3); cluster 2: classes 0,1,2 (1:1:2)
    y = np.array([0, 1, 1, 2, 2, 2, 0, 1, 2, 2])
    groups = np.array([0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    out = label_overlap(y, groups, 3)
    # shared classes: (0,1) 1, (0,2) 2, (1,2) 2
    assert out["shared_min"] == 1 and out["shared_max"] == 2
    assert np.isclose(out["shared_mean"], 5 / 3)
    assert out["classes_in_every_cluster"] == 1  # class 1
    # TV: (0,1) 0.5*(.5+.25+.75)=0.75; (0,2) 0.5*(.25+.25+.5)=0.5; (1,2) 0.5*(.25+0+.25)=0.25
    assert np.isclose(out["tv_min"], 0.25) and np.isclose(out["tv_max"], 0.75)
    assert np.isclose(out["tv_mean"], 0.5)


def test_split_separation_on_two_blocks() -> None:
    """Three clusters of 3; clusters 1 and 2 alike (cosine 0.7 across, 0.9 within), cluster
    0 apart (0.1): the merged pair is (1, 2), split exactly, separation 0.9 - 0.7 = 0.2; a
    single cluster (all 0.9) splits with separation 0."""
    groups = np.repeat([0, 1, 2], 3)
    cos = np.where(groups[:, None] == groups[None, :], 0.9, 0.1)
    pair = np.isin(groups, [1, 2])
    cos[np.ix_(pair, pair)] = np.where(groups[pair][:, None] == groups[pair][None, :], 0.9, 0.7)
    np.fill_diagonal(cos, 1.0)
    block = np.array(
        [[cos[np.ix_(groups == a, groups == b)].mean() for b in range(3)] for a in range(3)]
    )
    out = _split_separations(cos, groups, block)
    assert out["merged_pair"] == [1, 2]
    assert np.isclose(out["merged_separation"], 0.2)
    assert out["merged_halves_match_clusters"] == 1.0
    assert np.isclose(out["single_cluster_separation_max"], 0.0)
