"""A label-flipping client on Flower relabels its own data where it trains (scenario.faulty)."""

from __future__ import annotations

import yaml

from fedcluster.config.schema import validate_config
from fedcluster.data.configured import build_federation_for
from fedcluster.experiment.scenario import Scenario
from fedcluster.flower.client import _client
from tests.helpers import rotated_mnist5k

CONFIG = {
    "name": "label-flip-node",
    "seeds": [1],
    "rounds": 1,
    "data": rotated_mnist5k(5),
    "model": {"name": "mlp", "options": {"hidden": [8]}},
    "scenario": {"faulty": {"share": 0.4, "kinds": ["label_flip"]}},
}


def test_a_flower_node_trains_a_label_flipper_on_flipped_labels():
    config = validate_config(CONFIG)
    federation = build_federation_for(config, 1)
    flippers = Scenario(config.scenario, 5, 1, 1).label_flippers().tolist()
    assert len(flippers) == 2
    for client in range(5):
        y = federation.y_train[federation.client_slice(client)]
        want = 9 - y if client in flippers else y
        node = _client(yaml.safe_dump(CONFIG), 1, client)
        assert node.federation.y_train.tolist() == want.tolist()
        assert (
            node.federation.y_test.tolist()
            == federation.y_test[federation.client_slice(client, "test")].tolist()
        )
