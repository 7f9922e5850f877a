"""The server waits for Flower's nodes to connect before discovery."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="the Flower backend needs `pip install 'fedcluster[flower]'`")

from fedcluster.flower.flower_backend import FlowerClientError, connected_nodes  # noqa: E402


class LateGrid:
    """A grid whose nodes connect after ``empty`` polls (as Flower's simulation
    runtime registers its nodes on its own thread, possibly after the ServerApp starts)."""

    def __init__(self, empty: int, nodes: list[int]) -> None:
        self.empty, self.nodes, self.polls = empty, nodes, 0

    def get_node_ids(self) -> list[int]:
        self.polls += 1
        return [] if self.polls <= self.empty else list(self.nodes)


def test_discovery_waits_for_nodes_that_connect_late():
    grid = LateGrid(empty=3, nodes=[7, 2, 5])
    assert connected_nodes(grid, wait=5.0, poll=0.001) == [2, 5, 7]
    assert grid.polls == 4


def test_no_node_within_the_wait_is_a_one_line_error():
    with pytest.raises(FlowerClientError, match="no Flower node connected within 0.05 s"):
        connected_nodes(LateGrid(empty=10**9, nodes=[1]), wait=0.05, poll=0.01)
