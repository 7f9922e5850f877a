"""The report's per-client sections against values computed by hand on made-up rows."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from fedcluster.experiment.client_results import CLIENT_COLUMNS, client_line, read_clients
from fedcluster.reporting import clients


def frame(rows: list[tuple]) -> pd.DataFrame:
    """(round, algorithm, seed, client, group, cluster, accuracy, samples) rows, as
    clients.csv holds them (loss left out: no section reads it)."""
    records = [dict(zip(CLIENT_COLUMNS, (*r[:7], 0.0, r[7]), strict=True)) for r in rows]
    final = pd.DataFrame(records).astype({"group": "Int64", "cluster": "Int64"})
    final["correct"] = (final["accuracy"] * final["samples"]).round()
    return final


def test_group_accuracy_pools_each_groups_test_samples_and_averages_seeds():
    final = frame(
        [
            (5, "ifca", 0, 0, 0, 1, 0.5, 10),  # group 0, seed 0: (5 + 9) / (10 + 10)
            (5, "ifca", 0, 1, 0, 1, 0.9, 10),
            (5, "ifca", 0, 2, 1, 0, 1.0, 4),  # group 1, seed 0: 4 / 4
            (5, "ifca", 1, 0, 0, 0, 0.2, 10),  # group 0, seed 1: (2 + 6) / (10 + 30)
            (5, "ifca", 1, 1, 0, 0, 0.2, 30),
            (5, "ifca", 1, 2, 1, 1, 0.5, 4),  # group 1, seed 1: 2 / 4
        ]
    )
    (row,) = clients.group_accuracy(final)
    assert row["group 0"] == f"{100 * (14 / 20 + 8 / 40) / 2:.1f}"
    assert row["group 1"] == f"{100 * (1.0 + 0.5) / 2:.1f}"


def test_worst_clients_are_the_lowest_tenth_rounded_up():
    accuracies = [0.05 * (i + 1) for i in range(15)]  # 15 clients: the worst 2
    final = frame([(3, "fedavg", 0, c, None, None, a, 20) for c, a in enumerate(accuracies)])
    final = pd.concat([final, frame([(3, "fedavg", 0, 15, None, None, math.nan, 0)])])
    (row,) = clients.worst_clients(final)
    assert row["clients"] == "15"  # the client without test data is left out
    assert row["worst 10% acc %"] == f"{100 * (0.05 + 0.10) / 2:.1f}"
    assert row["lowest acc %"] == "5.0"
    assert row["mean acc %"] == f"{100 * sum(accuracies) / 15:.1f}"
    assert row["worst clients"] == "0 (5%), 1 (10%) (seed 0)"


def test_cluster_size_counts_the_clients_sharing_a_cluster_in_each_job():
    final = frame(
        [
            (2, "ifca", 0, 0, 0, 0, 0.5, 10),
            (2, "ifca", 0, 1, 0, 0, 0.5, 10),
            (2, "ifca", 0, 2, 1, 1, 0.5, 10),
            (2, "ifca", 0, 3, 1, -1, 0.5, 10),  # unassigned: no size
            (2, "fedavg", 0, 0, 0, None, 0.5, 10),  # unclustered: no size
        ]
    )
    sized = clients.cluster_sizes(final)
    assert list(zip(sized.client, sized["size"], strict=True)) == [(0, 2), (1, 2), (2, 1)]


def test_read_clients_keeps_labels_text_and_empty_cells_missing(tmp_path):
    header = ",".join(CLIENT_COLUMNS)
    record = dict(zip(CLIENT_COLUMNS, (1, "10", 0, 3, None, None, 0.5, 0.7, 4), strict=True))
    (tmp_path / "clients.csv").write_text(header + "\n" + ",".join(client_line(record)) + "\n")
    read = read_clients(tmp_path)
    assert read["algorithm"].tolist() == ["10"]
    assert read["group"].isna().all() and read["cluster"].isna().all()
    assert read["accuracy"].tolist() == [pytest.approx(0.5)]
    assert read_clients(tmp_path / "absent").columns.tolist() == CLIENT_COLUMNS
