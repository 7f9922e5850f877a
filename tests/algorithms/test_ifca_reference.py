"""IFCA's rotated-MNIST experiment (Ghosh et al. 2020, reference code mnist/): the
per-group federation, the own-loss test protocol and the full-batch kernel path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedcluster.algorithms.base import Context
from fedcluster.algorithms.evaluation import own_loss_evaluate
from fedcluster.config.schema import resolve_config
from fedcluster.data.configured import load_partitioned
from fedcluster.data.federation import Federation, build_federation
from fedcluster.data.partitions import Partition, make_partition
from fedcluster.data.sources import Dataset, Split
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.mlp_kernel import MLPKernel
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining
from fedcluster.rng import numpy_rng
from tests.helpers import unequal_clients

EPS32 = torch.finfo(torch.float32).eps


def _labels(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % 10)


def _per_group(y: np.ndarray, y_test: np.ndarray, groups: int, clients: int, t: int) -> Partition:
    return make_partition(
        "rotation",
        y,
        y_test,
        numpy_rng(0, "partition"),
        n_groups=groups,
        reuse="per_group",
        test_clients=t,
        base="iid",
        base_options={"n_clients": clients, "samples_per_client": len(y) // clients},
    )


def _check_ifca_layout(p: Partition, n_train: int, n_test: int, groups: int, t: int) -> None:
    """IFCA's federation: group g = clients g·m..(g+1)·m−1 at 360·g/p degrees, each group a
    partition of the whole train pool, client j of a group testing on test chunk j mod t."""
    m = p.n_clients // groups
    assert p.n_clients == groups * m
    assert p.groups.tolist() == np.repeat(np.arange(groups), m).tolist()
    assert p.rotations.tolist() == np.repeat(360.0 * np.arange(groups) / groups, m).tolist()
    chunks = np.array_split(np.arange(n_test), t)
    for g in range(groups):
        members = range(g * m, (g + 1) * m)
        held = np.concatenate([p.train[c] for c in members])
        assert np.array_equal(np.sort(held), np.arange(n_train))  # every image exactly once
        assert all(len(p.train[c]) == n_train // m for c in members)
        for j, c in enumerate(members):
            assert np.array_equal(p.test[c], chunks[j % t])


def test_per_group_rotation_reuses_the_pool_once_per_group():
    y, y_test = _labels(120), _labels(40, seed=1)
    p = _per_group(y, y_test, groups=4, clients=12, t=4)
    assert p.test_pool == "test"
    _check_ifca_layout(p, 120, 40, groups=4, t=4)
    # the groups are different permutations of the pool
    assert not all(np.array_equal(p.train[c], p.train[c + 12]) for c in range(12))
    two = _per_group(y, y_test, groups=2, clients=6, t=2)
    _check_ifca_layout(two, 120, 40, groups=2, t=2)
    assert sorted(set(two.rotations.tolist())) == [0.0, 180.0]  # IFCA p = 2: k = 2·(i mod 2)


def test_per_group_options_fail_clearly():
    y, y_test = _labels(120), _labels(40, seed=1)
    with pytest.raises(ConfigError, match="'test_clients' needs reuse='per_group'"):
        make_partition("rotation", y, y_test, numpy_rng(0, "p"), test_clients=4)
    with pytest.raises(ConfigError, match="'reuse' must be one of"):
        make_partition("rotation", y, y_test, numpy_rng(0, "p"), reuse="always")
    with pytest.raises(ConfigError, match="'test_clients'.*exceed"):
        _per_group(y, y_test, groups=2, clients=6, t=41)
    with pytest.raises(ConfigError, match="needs a dataset with a test split"):
        make_partition("rotation", y, None, numpy_rng(0, "p"), reuse="per_group", test_clients=2)


def test_built_federation_rotates_each_group_of_the_reused_pool():
    gen = torch.Generator().manual_seed(0)
    y, y_test = _labels(24), _labels(8, seed=1)
    ds = Dataset(
        "tiny",
        Split(torch.rand(24, 1, 5, 5, generator=gen), torch.as_tensor(y)),
        Split(torch.rand(8, 1, 5, 5, generator=gen), torch.as_tensor(y_test)),
        tuple(str(c) for c in range(10)),
    )
    p = _per_group(y, y_test, groups=4, clients=3, t=2)
    fed = build_federation(ds, p)
    for c in range(fed.n_clients):
        k = c // 3  # quarter turns of group k
        sl, st = fed.client_slice(c), fed.client_slice(c, "test")
        expect = torch.rot90(ds.train.x[torch.as_tensor(p.train[c])], k, dims=(2, 3))
        assert torch.equal(fed.x_train[sl], expect)
        expect = torch.rot90(ds.test.x[torch.as_tensor(p.test[c])], k, dims=(2, 3))
        assert torch.equal(fed.x_test[st], expect)


def test_preset_builds_ifcas_reference_federation_on_real_mnist(shared_data_dir):
    cfg = resolve_config(preset="ifca-rotated-mnist", sets=[f"data.data_dir={shared_data_dir}"])
    assert cfg.rounds == 300 and cfg.train.steps == 10 and cfg.train.batch_size == 100
    assert cfg.train.lr == 0.1 and cfg.evaluation.model_choice == "own_loss"
    assert [a.name for a in cfg.algorithms] == ["ifca", "fedavg", "local"]
    data = load_partitioned(cfg, 0)
    ds, p = data.dataset, data.partition
    assert len(ds.train.y) == 60000 and len(ds.test.y) == 10000
    assert p.n_clients == 2400
    _check_ifca_layout(p, 60000, 10000, groups=4, t=100)
    assert {len(t) for t in p.test} == {100}  # 400 distinct test clients of 100 images
    assert len({tuple(p.test[c]) + (p.groups[c],) for c in range(2400)}) == 400


# ------------------------------------------------------------------ full-batch kernel


def _mlp_kernel(*widths: int) -> tuple[MLPKernel, torch.Tensor]:
    model = build_model("mlp", (widths[0],), widths[-1], hidden=list(widths[1:-1]))
    kernel = MLPKernel.detect(model, ParamLayout(model))
    assert kernel is not None
    return kernel, ParamLayout(model).flatten(model)


@pytest.mark.parametrize("widths", [(20, 16, 3), (20, 3)])
def test_full_batch_steps_equal_step_by_step_sgd(widths):
    kernel, row = _mlp_kernel(*widths)
    g, steps, n = 3, 6, 5
    gen = torch.Generator().manual_seed(1)
    rows = row + 0.1 * torch.randn(g, row.numel(), generator=gen)
    x = torch.randn(g, n, widths[0], generator=gen)
    y = torch.randint(0, widths[-1], (g, n), generator=gen)
    weight = torch.full((g, steps, n), 1.0 / n)
    weight[1, :, 3:] = 0.0  # a member with 3 samples (2 padding rows)
    weight[1, :, :3] = 1.0 / 3
    weight[2, 4:] = 0.0  # a member that takes 4 steps only
    params = kernel.unpack(rows)
    stepwise = torch.zeros(g)
    for s in range(steps):
        stepwise += kernel.sgd_step(params, x, y, weight[:, s], 0.3)[0]
    expected = torch.empty_like(rows)
    kernel.pack(params, expected)
    fast = rows.clone()
    total = kernel.sgd_full_batch(fast, x, y, weight, 0.3, torch.bmm(x, x.transpose(1, 2)))
    # Re-associated float32 sums of at most f + n terms of size O(1), over 6 steps at lr 0.3.
    tol = steps * 0.3 * (widths[0] + n) * EPS32 * 10
    assert (fast - expected).abs().max().item() <= tol
    assert torch.allclose(total, stepwise, atol=tol)
    assert not torch.equal(fast, rows)


@pytest.fixture(scope="module")
def mnist_clients(shared_dataset) -> Federation:
    """10 clients of 30..100 real MNIST digits (unequal: padding in the groups)."""
    return unequal_clients(shared_dataset("mnist"), 10, 30, 101, test_n=15, seed=5)


@pytest.mark.parametrize("model_name", ["mlp", "mclr"])
@pytest.mark.parametrize("shared_start", [False, True])
def test_simulator_full_batch_training_equals_the_plain_loop(
    mnist_clients, model_name, shared_start, monkeypatch
):
    options = {"hidden": [200]} if model_name == "mlp" else {}
    model = build_model(model_name, (1, 28, 28), 10, **options)
    cfg = LocalTraining(lr=0.1, batch_size=100, steps=10)  # IFCA: tau full-batch steps
    clients = np.arange(mnist_clients.n_clients)
    layout = ParamLayout(model)
    if shared_start:
        start = layout.flatten(model).expand(len(clients), -1)
    else:
        start = torch.stack(
            [layout.flatten(build_model(model_name, (1, 28, 28), 10, **options)) for _ in clients]
        )
    sim = Simulator(model, mnist_clients, seed=4, group_size=3)
    calls = []
    original = sim.kernel.sgd_full_batch
    monkeypatch.setattr(
        sim.kernel, "sgd_full_batch", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    fast = sim.train(clients, start, cfg, rnd=1)
    plain = reference_train(model, mnist_clients, clients, start, cfg, seed=4, rnd=1)
    assert calls  # the full-batch route ran
    # Pixels in [0, 1]: Gram entries up to 784; 10 steps at lr 0.1 of re-associated sums of
    # at most 784 + 100 float32 terms whose gradient contributions are O(1).
    tol = 10 * 0.1 * (784 + 100) * EPS32 * 10
    assert (fast.rows - plain).abs().max().item() <= tol
    assert not torch.equal(fast.rows, start)


# ------------------------------------------------------------------ own-loss evaluation


def test_own_loss_protocol_picks_each_clients_lowest_test_loss(mnist_clients):
    model = build_model("mlp", (1, 28, 28), 10, hidden=[16])
    layout = ParamLayout(model)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(3, layout.dim, generator=gen) * 0.3
    sim = Simulator(model, mnist_clients, seed=0)
    ctx = Context.for_backend(sim, LocalTraining(lr=0.1, batch_size=16), 0, rows[0])
    clients = np.arange(mnist_clients.n_clients)
    result, choice = own_loss_evaluate(ctx, clients, rows, rnd=1)
    for i, c in enumerate(clients):  # an independent loop over clients and models
        st = mnist_clients.client_slice(int(c), "test")
        x, y = mnist_clients.x_test[st], mnist_clients.y_test[st]
        losses, hits = [], []
        for j in range(3):
            layout.load_into(model, rows[j])
            with torch.no_grad():
                logits = model(x)
            losses.append(F.cross_entropy(logits, y).item())
            hits.append(int((logits.argmax(1) == y).sum()))
        best = int(np.argmin(losses))
        assert choice[i] == best
        assert result.correct[i] == hits[best] and result.count[i] == len(y)
        assert result.loss_sum[i] == pytest.approx(losses[best] * len(y), rel=1e-5)
    assert len(set(choice.tolist())) > 1  # the test is not trivial: clients choose differently


# ------------------------------------------------------------------ device setting


def test_device_auto_is_the_cpu_path_without_a_gpu(mnist_clients, monkeypatch):
    from fedcluster.engine.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    moved = mnist_clients.to(resolve_device("auto"))
    assert moved is mnist_clients  # already there: no copy, drift reaches every holder
    model = build_model("mlp", (1, 28, 28), 10, hidden=[32])
    cfg = LocalTraining(lr=0.1, batch_size=16, epochs=1)
    start = ParamLayout(model).flatten(model)
    clients = np.arange(4)
    auto = Simulator(model, moved, seed=1).train(clients, start, cfg, rnd=1).rows
    plain = Simulator(model, mnist_clients, seed=1).train(clients, start, cfg, rnd=1).rows
    assert auto.device.type == "cpu" and torch.equal(auto, plain)


def test_cuda_without_a_gpu_is_a_one_line_config_error(monkeypatch, tmp_path):
    from fedcluster.engine.device import resolve_device
    from fedcluster.experiment.runner import Experiment

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU") as err:
        resolve_device("cuda")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="must be one of"):
        resolve_device("tpu")
    cfg = resolve_config(
        preset="quickstart", sets=["device=cuda", "rounds=1", "data.dataset=digits"]
    )
    with pytest.raises(ConfigError, match="device: 'cuda'"):
        Experiment(cfg).run(tmp_path / "run", progress=False)


def test_cli_reports_cuda_without_a_gpu_with_exit_code_2(tmp_path):
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcluster.cli",
            "run",
            "--preset",
            "quickstart",
            "--set",
            "device=cuda",
            "--set",
            "data.dataset=digits",
            "--rounds",
            "1",
            "--out",
            str(tmp_path / "r"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "no CUDA GPU" in errors[0]
    assert not (tmp_path / "r").exists()  # nothing written
