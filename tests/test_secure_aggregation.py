"""Secure aggregation per cluster (fedcluster.protocol.secure_sum) in the simulator.

A device's contribution against a hand computation; rounds that receive only the
sums release the trusted server's models (the same noise, the sums to float
rounding), move the clip norm the same way and spend the same ε; what cannot
run without individual uploads is refused with one line naming the setting.
"""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from fedcluster.algorithms.cluster_models import private_initial_models
from fedcluster.algorithms.dcfl import DCFL, DCFLParams
from fedcluster.algorithms.fedavg import FedAvg, FedAvgParams
from fedcluster.algorithms.fedgroup import FedGroup, FedGroupParams
from fedcluster.algorithms.ifca import IFCA, IFCAParams
from fedcluster.algorithms.jgl import JGL, JGLParams
from fedcluster.config.schema import resolve_config
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment
from fedcluster.privacy.central import CentralDP
from fedcluster.privacy.private_start import PrivateStart
from fedcluster.protocol.secure_sum import LOSS_CAP, SecureTotal, share_length, shares
from tests.helpers import make_context, rotated_digits

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:opacus.*"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:opacus.*"),
]


def test_a_contribution_is_the_clipped_update_in_its_clusters_slot():
    """s = [e_c ⊗ clip(w − W_c, C) | e_c | 1[‖w − W_c‖ ≤ C] | min(loss, L)], by hand."""
    models = torch.tensor([[0.0, 0.0], [1.0, 1.0], [-1.0, 2.0]], dtype=torch.float64)
    rows = torch.tensor([[4.0, 5.0], [-0.9, 2.1]], dtype=torch.float64)  # (3, 4), (0.1, 0.1)
    got = shares(rows, models, torch.tensor([1, 2]), torch.tensor([20.0, 0.5]), clip=1.0)
    expected = torch.tensor(
        [
            [0, 0, 0.6, 0.8, 0, 0, 0, 1, 0, 0, LOSS_CAP],  # ‖(3, 4)‖ = 5 → (0.6, 0.8), clipped
            [0, 0, 0, 0, 0.1, 0.1, 0, 0, 1, 1, 0.5],  # within C: unchanged, bit 1
        ],
        dtype=torch.float64,
    )
    assert got.shape == (2, share_length(3, 2))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    total = SecureTotal.from_vector(got.sum(dim=0), 3, 2)
    torch.testing.assert_close(total.sums, expected[:, :6].sum(0).reshape(3, 2))
    assert total.counts.tolist() == [0, 1, 1] and total.n == 2
    assert total.unclipped == 1.0 and total.loss_sum == LOSS_CAP + 0.5


def _central(n: int) -> CentralDP:
    return CentralDP(n, seed=5, delta=1e-5, noise_multiplier=1.5, count_noise=2.0,
                     sample_rate=1.0, clip=0.3)  # fmt: skip


def _rounds(algorithm_cls, params, secure: bool, rounds: int = 3):
    fed = rotated_digits(n_groups=2, clients_per_group=4, per_client=40)
    ctx = make_context(fed)
    ctx.aggregate = ctx.central = _central(fed.n_clients)
    ctx.secure = secure
    algorithm = algorithm_cls(params, ctx)
    state = algorithm.init_state()
    selected = np.arange(fed.n_clients)
    for rnd in range(1, rounds + 1):
        ctx.central.start_round(rnd)
        state = algorithm.run_round(state, rnd, selected).state
        ctx.central.end_round()
    return state, ctx.central


def _models(state) -> torch.Tensor:
    return state.global_model.unsqueeze(0) if hasattr(state, "global_model") else state.models


@pytest.mark.parametrize(
    "algorithm_cls,params",
    [
        (FedAvg, FedAvgParams()),
        (IFCA, IFCAParams(n_clusters=2, choice_on_device=True)),
        (JGL, JGLParams(n_clusters=2, choice_on_device=True, empty_cluster_fix=False)),
        (DCFL, DCFLParams(n_clusters=2, choice_on_device=True)),
        (FedGroup, FedGroupParams(n_groups=2, choice_on_device=True)),
    ],
    ids=["fedavg", "ifca", "jgl", "dcfl", "fedgroup"],
)
def test_rounds_that_see_only_the_sums_release_the_trusted_servers_models(algorithm_cls, params):
    """The same choices on the devices, the same noise per cluster, the same clip norm and
    ledger: the models differ only by the float rounding of the sums (float64 on the
    device side, float32 at the trusted server: n·C·2⁻²³ per coordinate and round,
    compounded over the rounds' training)."""
    rounds, n, clip = 3, 8, 0.3
    trusted, dp_trusted = _rounds(algorithm_cls, params, secure=False, rounds=rounds)
    secure, dp_secure = _rounds(algorithm_cls, params, secure=True, rounds=rounds)
    # one round's rounding: a float32 sum of n clipped coordinates and |w| ≤ 1, n·C·2⁻²³ +
    # 2⁻²⁴; a later round's training may amplify an earlier difference (a factor 10 allowed)
    bound = rounds * 10 * (n * clip * 2**-23 + 2**-24)
    torch.testing.assert_close(_models(secure), _models(trusted), rtol=0, atol=bound)
    initial = _rounds(algorithm_cls, params, secure=True, rounds=0)[0]
    assert (_models(secure) - _models(initial)).abs().max() > 100 * bound  # the rounds moved them
    assert dp_secure.clip == pytest.approx(dp_trusted.clip, rel=1e-12)
    np.testing.assert_array_equal(dp_secure.releases, dp_trusted.releases)
    if hasattr(secure, "assign"):  # the server never learns who chose which cluster
        assert (secure.assign == -1).all() and (trusted.assign >= 0).any()


@pytest.mark.parametrize("z", [0.0, 2.0], ids=["noise-free", "noisy"])
def test_a_private_start_from_secure_sums_gives_the_trusted_servers_models(z):
    """The private start's sums gathered from the devices (each its own term, the server
    only the sum) give the models and ledger of the trusted server that computes them
    from the uploads: the same noise draws, sums to float rounding, the same groups."""
    fed = rotated_digits(n_groups=2, clients_per_group=6, per_client=40)
    params = PrivateStart(sketch_dim=8, iterations=2)
    out = []
    for secure in (False, True):
        ctx = make_context(fed)
        central = _central(fed.n_clients)
        central.start_noise, central.start_releases = z, params.releases
        ctx.aggregate = ctx.central = central
        ctx.secure = secure
        out.append((private_initial_models(ctx, 2, params, "test"), central.started.copy()))
    (trusted, started), (secure_models, secure_started) = out
    # float32 sums of n = 12 clipped updates (|entry| ≤ C = 0.3) over a float64 sum
    torch.testing.assert_close(secure_models, trusted, rtol=0, atol=12 * 0.3 * 2**-22)
    assert (trusted - trusted.mean(dim=0)).abs().max() > 1e-3  # two distinct groups' models
    np.testing.assert_array_equal(secure_started, started)
    assert (started == params.releases).all()


TINY = ["rounds=2", "privacy.mode=central", "privacy.epsilon=8", "privacy.count_noise=5"]


def test_a_secure_run_spends_the_budget_and_repeats_itself(tmp_path):
    algorithms = (
        "algorithms=[{name: fedavg}, {name: ifca, params: {n_clusters: 2, choice_on_device: "
        "true}}, {name: dcfl, params: {n_clusters: 2, choice_on_device: true}}, "
        "{name: fedgroup, params: {n_groups: 2, choice_on_device: true}}]"
    )
    sets = [*TINY, "privacy.secure_aggregation=true", algorithms]
    config = resolve_config(None, "quickstart", sets, {"seeds": [0]})
    rows = []
    for out in ("a", "b"):
        Experiment(config).run(tmp_path / out, progress=False)
        with (tmp_path / out / "metrics.csv").open() as f:
            rows.append(
                [{k: v for k, v in r.items() if "seconds" not in k} for r in csv.DictReader(f)]
            )
    assert rows[0] == rows[1] and len(rows[0]) == 4 * 2
    for row in [r for r in rows[0] if r["round"] == "2"]:  # every job spends the budget
        assert 7.99 < float(row["epsilon"]) <= 8.0
        assert float(row["bytes_up"]) > 0


def test_without_the_assignment_a_client_is_tested_with_its_lowest_loss_model(tmp_path):
    """The server never learns who chose which cluster, so every client is evaluated with
    the model of lowest training loss (IFCA's choice); with little noise (ε = 10⁴) the
    secure runs test as well as the trusted server's, which evaluate each client with
    the cluster it chose (DCFL and FedGroup: the cluster mean for one never selected)."""
    algorithms = (
        "algorithms=[{name: ifca, params: {n_clusters: 2, choice_on_device: true}}, "
        "{name: dcfl, params: {n_clusters: 2, choice_on_device: true}}, "
        "{name: fedgroup, params: {n_groups: 2, choice_on_device: true}}]"
    )
    accuracy = {}
    for secure in ("false", "true"):
        sets = [*TINY, "privacy.epsilon=1e4", f"privacy.secure_aggregation={secure}", algorithms]
        config = resolve_config(None, "quickstart", sets, {"seeds": [0], "rounds": 4})
        Experiment(config).run(tmp_path / secure, progress=False)
        with (tmp_path / secure / "metrics.csv").open() as f:
            last = [r for r in csv.DictReader(f) if r["round"] == "4"]
        accuracy[secure] = {r["algorithm"]: float(r["accuracy"]) for r in last}
    for name, trusted in accuracy["false"].items():
        assert trusted > 0.25  # far above chance (0.1): the comparison is about real models
        assert accuracy["true"][name] >= trusted - 0.05, (name, accuracy)


@pytest.mark.parametrize(
    "change,error",
    [
        (["privacy.mode=none"], "needs privacy.mode: central"),
        (["algorithms=[{name: cfl}]"], "not available for algorithm 'cfl'"),
        (["algorithms=[{name: ifca, params: {n_clusters: 2}}]"], "choice_on_device: true"),
        (
            ["algorithms=[{name: jgl, params: {n_clusters: 2, choice_on_device: true}}]"],
            "empty_cluster_fix",
        ),
        (
            [
                "algorithms=[{name: ifca, params: {n_clusters: 2, choice_on_device: true}}]",
                "scenario.faulty.share=0.2",
            ],
            "garbles uploads",
        ),
    ],
    ids=["not-central", "cfl", "server-choice", "jgl-pins", "faults"],
)
def test_what_secure_aggregation_cannot_serve_is_refused(tmp_path, change, error):
    ifca = "algorithms=[{name: ifca, params: {n_clusters: 2, choice_on_device: true}}]"
    sets = [*TINY, "privacy.secure_aggregation=true", ifca, *change]
    config = resolve_config(None, "quickstart", sets, {"seeds": [0]})
    with pytest.raises(ConfigError, match=error):
        Experiment(config).run(tmp_path, progress=False)
    assert not (tmp_path / "metrics.csv").exists()
