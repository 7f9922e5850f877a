"""FedEM (Marfoq et al., NeurIPS 2021): the E-step against its closed form, one component
against FedAvg, and the mixture weights in diagnostics.csv."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from fedcluster.algorithms.fedavg import FedAvg
from fedcluster.algorithms.fedem import FedEM, e_step, mixture_nll
from fedcluster.config.schema import validate_config
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment
from fedcluster.protocol.batches import LocalTraining
from tests.algorithms.test_flhc_fesem import N, disjoint  # noqa: F401  (fixture)
from tests.helpers import make_context, rotated_mnist5k


def test_e_step_equals_the_closed_form():
    """q_im = π_m e^{−ℓ_im} / Σ_k π_k e^{−ℓ_ik} (eq. 8), π'_m = mean_i q_im (eq. 9),
    NLL = −mean_i log Σ_m π_m e^{−ℓ_im}, written out by hand for 2 samples, 3 components."""
    losses = torch.tensor([[0.5, 2.0, 1.0], [3.0, 0.1, 0.2]])
    pi = torch.tensor([0.5, 0.3, 0.2])
    q, new = e_step(losses, pi)
    for i in range(2):
        terms = [pi[m].item() * math.exp(-losses[i, m].item()) for m in range(3)]
        for m in range(3):
            assert q[i, m].item() == pytest.approx(terms[m] / sum(terms), rel=1e-12)
    assert new.tolist() == pytest.approx(q.mean(dim=0).tolist(), rel=1e-12)
    assert new.sum().item() == pytest.approx(1.0)
    hand = -np.mean(
        [
            math.log(sum(pi[m].item() * math.exp(-losses[i, m].item()) for m in range(3)))
            for i in (0, 1)
        ]
    )
    assert mixture_nll(losses, pi) == pytest.approx(hand, rel=1e-12)


@pytest.mark.parametrize("m", [1, 3])
def test_fedem_with_identical_components_is_fedavg_at_a_1_over_m_step(disjoint, m):  # noqa: F811
    """M identical components: every responsibility is 1/M, so each component trains with
    (1/M) × the mean loss (the reference code's Σ_i q_im ℓ_i / |B|), i.e. FedAvg's step at
    lr/M; the server's average is FedAvg's. FedEM at M × the rate gives FedAvg's model in
    every component, to float rounding (autograd vs the MLP kernel): why FedEM at the rate
    of the other methods trains slowly while its responsibilities are near uniform
    (docs/reproduction.md, "The clustered methods of today")."""
    rows = []
    for cls, params, lr in ((FedEM, FedEM.Params(n_components=m), 0.1 * m), (FedAvg, None, 0.1)):
        ctx = make_context(
            disjoint, train=LocalTraining(lr=lr, batch_size=16, epochs=1), hidden=[16]
        )
        ctx.init_row = ctx.fresh_rows(1, "fedem/components")[0]
        alg = cls(params or FedAvg.Params(), ctx)
        state = alg.init_state()
        if cls is FedEM:
            state.components = ctx.init_row.repeat(m, 1)
        for rnd in (1, 2):
            ctx.channel.start_round()
            state = alg.run_round(state, rnd, np.arange(N)).state
        rows.append(state.components if cls is FedEM else state.global_model[None])
    fedem, fedavg = rows
    assert torch.allclose(fedem, fedavg.expand_as(fedem), atol=1e-5)


def test_fedem_mixture_weights_in_diagnostics_and_refusals(tmp_path):
    config = {
        "name": "fedem",
        "seeds": [0],
        "rounds": 1,
        "data": rotated_mnist5k(4),
        "model": {"name": "mlp", "options": {"hidden": [8]}},
        "train": {"lr": 0.1, "batch_size": 64, "epochs": 1},
        "algorithms": [{"name": "fedem", "params": {"n_components": 2}}],
    }
    Experiment(validate_config(config)).run(tmp_path / "run", progress=False)
    with open(tmp_path / "run/diagnostics.csv", newline="") as f:
        pi = [r for r in csv.DictReader(f) if r["name"].startswith("pi/")]
    by_client: dict[str, float] = {}
    for r in pi:
        client = r["name"].split("/")[1]
        by_client[client] = by_client.get(client, 0.0) + float(r["value"])
    assert len(pi) == 4 * 2 and all(v == pytest.approx(1.0) for v in by_client.values())
    with pytest.raises(ConfigError, match="train: fedem trains with plain SGD"):
        Experiment(validate_config({**config, "train": {"momentum": 0.9}})).run(
            tmp_path / "momentum", progress=False
        )
