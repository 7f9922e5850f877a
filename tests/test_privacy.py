"""Local differential privacy: calibration, noise, clipping, accounting, determinism, DP-SGD."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from benchmarks.reproduction.dp_modes import BUDGET, FEDERATIONS
from fedcluster.algorithms.base import init_row
from fedcluster.config.schema import resolve_config
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment
from fedcluster.models import build_model
from fedcluster.privacy.ledger import LocalDP, max_participations
from fedcluster.privacy.mechanisms import (
    RecordDP,
    calibrate_noise,
    clip_rows,
    epsilon_spent,
    per_sample_gradients,
    release_uploads,
)
from fedcluster.protocol.batches import LocalTraining, batch_plan
from tests.helpers import assert_same_training, make_context, rotated_digits

# The independent accountant calls below warn as Opacus does (q = 1, extreme σ in the search).
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:opacus.*"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:opacus.*"),
]

TINY = [
    "data.dataset=digits",
    "data.partition={name: rotation, n_groups: 2, base: iid, "
    "base_options: {n_clients: 6, test_fraction: 0.2}}",
    "model.options={hidden: [16]}",
    "train={lr: 0.1, batch_size: 16, epochs: 1}",
    "checkpoint_every=2",
]


@pytest.fixture(scope="module")
def federation():
    return rotated_digits(n_groups=2, clients_per_group=4, per_client=40)


def client_dp(n: int, sigma: float, clip: float, budget: int = 100, seed: int = 0) -> LocalDP:
    return LocalDP(
        "client",
        seed=seed,
        clip=clip,
        delta=1e-5,
        noise_multiplier=np.full(n, sigma),
        sample_rate=np.ones(n),
        budget=np.full(n, budget),
    )


def upload(
    dp: LocalDP, clients: np.ndarray, start: torch.Tensor, trained: torch.Tensor, rnd: int
) -> torch.Tensor:
    """What the clients release (where they are), entered in the ledger."""
    tickets = [dp.ticket(int(c)) for c in clients]
    steps = torch.ones(len(clients), dtype=torch.int64)
    released = release_uploads(tickets, clients, start, trained, steps, dp.seed, rnd)
    dp.record(clients, steps, rnd)
    return released


# --------------------------------------------------------------- calibration
@pytest.mark.parametrize(
    "eps,q,steps",
    [(10.0, 1.0, 25), (1.0, 1.0, 25), (3.0, 0.25, 40)],
)
def test_calibrated_sigma_is_the_accountants_answer(eps, q, steps):
    sigma = calibrate_noise(eps, 1e-5, q, steps, "rdp")
    assert sigma == get_noise_multiplier(
        target_epsilon=eps, target_delta=1e-5, sample_rate=q, steps=steps, accountant="rdp"
    )
    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    spent = acc.get_epsilon(delta=1e-5)
    assert eps - 0.02 < spent <= eps
    # the per-round report is the accountant's number, also for fewer steps
    for k in (1, steps // 2, steps):
        acc.history = [(sigma, q, k)]
        assert epsilon_spent(sigma, q, k, 1e-5, "rdp") == pytest.approx(
            acc.get_epsilon(delta=1e-5), rel=1e-12
        )


def test_prv_calibration_is_the_accountants_answer():
    sigma = calibrate_noise(10.0, 1e-5, 1.0, 10, "prv")
    assert sigma == get_noise_multiplier(
        target_epsilon=10.0, target_delta=1e-5, sample_rate=1.0, steps=10, accountant="prv"
    )
    acc = PRVAccountant()
    acc.history = [(sigma, 1.0, 10)]
    assert 9.98 < acc.get_epsilon(delta=1e-5) <= 10.0
    assert epsilon_spent(sigma, 1.0, 10, 1e-5, "prv") == acc.get_epsilon(delta=1e-5)
    assert sigma < calibrate_noise(10.0, 1e-5, 1.0, 10, "rdp")  # PRV is the tighter bound


def test_record_level_ledger_is_opacus_for_a_known_configuration():
    """docs/privacy.md's record-level federation (``benchmarks.reproduction.dp_modes --federation
    records``): 1,500 samples, B = 64, one epoch, 16 uploads at (ε = 10, δ = 1e-5)."""
    sets = [*FEDERATIONS["records"].sets, "privacy.mode=record", BUDGET, "privacy.epsilon=10"]
    dp = LocalDP.from_config(resolve_config(None, "rotation", sets), np.array([1500]), 0)
    steps, q = 24, 1.0 / 24  # ⌈1500/64⌉ Poisson steps per epoch, each at rate 1/24
    assert dp.sample_rate.tolist() == [q] and dp.budget.tolist() == [16 * steps]
    sigma = float(dp.noise_multiplier[0])
    assert sigma == pytest.approx(0.79, abs=0.01)  # the σ docs/privacy.md states
    acc = RDPAccountant()
    acc.history = [(sigma, q, 16 * steps)]
    assert 9.99 < acc.get_epsilon(delta=1e-5) <= 10.0  # the whole budget spends ε = 10
    for rnd in (1, 2, 3):
        dp.record(np.array([0]), torch.tensor([steps]), rnd)
    acc = RDPAccountant()  # one step at a time, as Opacus' optimizer hook does
    for _ in range(3 * steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    assert dp.epsilons()[0] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)


# ------------------------------------------------------------------ the noise
def test_client_level_noise_has_std_sigma_times_clip():
    n, d, sigma, clip = 8, 20_000, 1.7, 0.5
    dp = client_dp(n, sigma, clip)
    start = torch.randn(n, d)
    noise = upload(dp, np.arange(n), start, start.clone(), rnd=1) - start  # zero update: pure noise
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.05)
    assert abs(noise.mean().item()) < 0.01 * sigma * clip


def test_dp_sgd_noise_has_std_sigma_times_clip(federation):
    # One step, lr 1: the σ and σ=0 runs differ by exactly the noise / batch size.
    model = build_model("mlp", federation.input_shape, 10, hidden=[256])
    sim = Simulator(model, federation, seed=0)
    clients = np.arange(federation.n_clients)
    start = init_row(model, 0, "init")
    sigma, clip, batch = 2.0, 0.3, 16

    def run(s: float) -> torch.Tensor:
        dp = RecordDP(clip=clip, noise_multiplier=s, poisson=False)
        cfg = LocalTraining(lr=1.0, batch_size=batch, steps=1, dp=dp)
        return sim.train(clients, start, cfg, rnd=1).rows

    noise = (run(0.0) - run(sigma)) * batch
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.05)


# ------------------------------------------------------------------- clipping
def test_uploaded_updates_are_clipped_to_c(federation):
    ctx = make_context(federation, hidden=[16], train=LocalTraining(lr=0.5, batch_size=8))
    clip = 0.2
    dp = client_dp(ctx.n_clients, 0.0, clip)
    ctx.channel.privacy = dp
    clients = np.arange(ctx.n_clients)
    raw = ctx.channel.backend.train(clients, ctx.init_row, ctx.train, 1).rows - ctx.init_row
    assert (raw.norm(dim=1) > clip).all()  # training moved every client further than C
    ex = ctx.exchange(clients, ctx.init_row, 1)
    norms = (ex.rows - ctx.init_row).norm(dim=1)
    assert (norms <= clip * (1 + 1e-5)).all()
    # clipping only scales: direction kept, short updates untouched
    cos = F.cosine_similarity(ex.rows - ctx.init_row, raw, dim=1)
    assert torch.allclose(cos, torch.ones_like(cos), atol=1e-5)
    short = torch.randn(5, 30) * 1e-3
    assert torch.equal(clip_rows(short, 1.0), short)


def test_dp_sgd_clips_every_per_sample_gradient(federation):
    model = build_model("mlp", federation.input_shape, 10, hidden=[16])
    sim = Simulator(model, federation, seed=3)
    row = init_row(model, 0, "init")
    x, y = federation.x_train[:12], federation.y_train[:12]
    grads, losses = per_sample_gradients(sim.layout, row, x, y)
    for i in range(12):  # vmap(grad) equals autograd sample by sample
        w = row.clone().requires_grad_(True)
        loss = F.cross_entropy(sim.layout.forward(w, x[i : i + 1]), y[i : i + 1])
        (g,) = torch.autograd.grad(loss, w)
        assert torch.allclose(grads[i], g, atol=1e-6)
        assert losses[i].item() == pytest.approx(loss.item(), abs=1e-6)
    clip = 0.5 * grads.norm(dim=1).median().item()
    clipped = clip_rows(grads, clip)
    assert (clipped.norm(dim=1) <= clip * (1 + 1e-5)).all()
    # a DP-SGD step (σ = 0) moves by exactly −lr · mean of the clipped per-sample gradients
    cfg = LocalTraining(
        lr=0.3, batch_size=8, steps=1, dp=RecordDP(clip=clip, noise_multiplier=0.0, poisson=False)
    )
    (idx,) = sim.plans(np.array([0]), cfg, 1, "train")[0]
    g_batch, _ = per_sample_gradients(
        sim.layout, row, federation.x_train[idx], federation.y_train[idx]
    )
    expected = row - 0.3 * clip_rows(g_batch, clip).mean(dim=0)
    got = sim.train(np.array([0]), row, cfg, rnd=1).rows[0]
    assert torch.allclose(got, expected, atol=1e-6)


# --------------------------------------------------------- DP-SGD vs plain SGD
@pytest.mark.parametrize(
    "model_name,options,momentum",
    [("mlp", {"hidden": [32]}, 0.0), ("mlp", {"hidden": [32]}, 0.5), ("cnn", {}, 0.5)],
)
def test_dp_sgd_without_noise_or_clipping_is_plain_sgd(federation, model_name, options, momentum):
    # MLP without momentum: the batched kernel; otherwise the autograd path
    model = build_model(model_name, federation.input_shape, 10, **options)
    clients = np.arange(4)
    start = init_row(model, 0, "init")
    plain_cfg = LocalTraining(lr=0.1, batch_size=16, epochs=2, momentum=momentum, mu=0.1)
    dp_cfg = replace(plain_cfg, dp=RecordDP(clip=1e9, noise_multiplier=0.0, poisson=False))
    sim = Simulator(model, federation, seed=5)
    plain = sim.train(clients, start, plain_cfg, rnd=3)
    private = sim.train(clients, start, dp_cfg, rnd=3)
    shape = federation.input_shape
    assert_same_training(model, shape, plain_cfg, plain.steps, private.rows, plain.rows)
    assert_same_training(model, shape, plain_cfg, plain.steps, private.loss, plain.loss)
    assert torch.equal(private.steps, plain.steps)
    assert not torch.equal(plain.rows[0], start)


@pytest.mark.parametrize("classifier_only", [False, True])
def test_mlp_kernel_dp_sgd_equals_the_autograd_path(federation, classifier_only):
    model = build_model("mlp", federation.input_shape, 10, hidden=[24, 12])
    clients = np.arange(federation.n_clients)
    start = init_row(model, 0, "init")
    sigma = tuple(0.5 + 0.1 * c for c in range(federation.n_clients))
    dp = RecordDP(clip=0.05, noise_multiplier=sigma, poisson=True)  # clipping is active
    cfg = LocalTraining(lr=0.2, batch_size=8, epochs=1, mu=0.05, dp=dp)
    args = (clients, start, cfg, 2, "train", classifier_only)
    kernel = Simulator(model, federation, seed=4, group_size=3).train(*args)
    autograd = Simulator(model, federation, seed=4, use_kernel=False).train(*args)
    shape = federation.input_shape
    assert_same_training(model, shape, cfg, kernel.steps, kernel.rows, autograd.rows)
    assert_same_training(model, shape, cfg, kernel.steps, kernel.loss, autograd.loss)
    assert torch.equal(kernel.steps, autograd.steps)
    if classifier_only:
        head = Simulator(model, federation, seed=4).layout.classifier_range()
        assert torch.equal(
            kernel.rows[:, : head.start], start.expand(len(clients), -1)[:, : head.start]
        )


def test_poisson_plan_is_what_the_accountant_assumes():
    cfg = LocalTraining(batch_size=10, epochs=3, dp=RecordDP(clip=1.0, poisson=True))
    sizes = [len(b) for r in range(200) for b in batch_plan(95, cfg, 0, "train", r, 1)]
    assert len(sizes) == 200 * 3 * 10  # ⌈95/10⌉ steps per epoch
    assert np.mean(sizes) == pytest.approx(95 / 10, rel=0.03)  # q = 1/10
    assert min(sizes) < 10 < max(sizes)  # batch sizes vary (Poisson), unlike shuffled batches
    again = batch_plan(95, cfg, 0, "train", 7, 1)
    same = batch_plan(95, cfg, 0, "train", 7, 1)
    assert all(torch.equal(a, b) for a, b in zip(again, same, strict=True))


# ---------------------------------------------------------------- determinism
def test_same_seed_same_noise_other_seed_other_noise():
    start = torch.zeros(3, 500)
    clients = np.array([0, 1, 2])
    a = upload(client_dp(3, 1.0, 1.0, seed=0), clients, start, start, rnd=4)
    b = upload(client_dp(3, 1.0, 1.0, seed=0), clients, start, start, rnd=4)
    c = upload(client_dp(3, 1.0, 1.0, seed=1), clients, start, start, rnd=4)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert not torch.allclose(a[0], a[1])  # clients draw different noise


def test_no_two_uploads_of_a_client_share_noise():
    dp = client_dp(1, 1.0, 1.0)
    start = torch.zeros(1, 500)
    first = upload(dp, np.array([0]), start, start, rnd=2)
    second = upload(dp, np.array([0]), start, start, rnd=2)  # e.g. a DCFL newcomer trains twice
    assert not torch.allclose(first, second)


def test_dp_sgd_noise_is_seeded(federation):
    model = build_model("mlp", federation.input_shape, 10, hidden=[16])
    start = init_row(model, 0, "init")
    cfg = LocalTraining(lr=0.1, batch_size=16, dp=RecordDP(clip=1.0, noise_multiplier=1.0))
    clients = np.arange(3)

    def run(seed: int) -> torch.Tensor:
        return Simulator(model, federation, seed=seed).train(clients, start, cfg, 1).rows

    assert torch.equal(run(0), run(0))
    assert not torch.allclose(run(0), run(1))


# ----------------------------------------------------------- budget and report
def _metrics(path: Path) -> list[dict[str, str]]:
    with open(path / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_reported_epsilon_is_monotone_and_within_budget(tmp_path):
    sets = [
        *TINY,
        "rounds=5",
        "algorithms=[{name: fedavg}, {name: dcfl}, {name: local}]",
        "privacy={mode: client, epsilon: 2.0, clip: 0.5, max_participations: 3}",
    ]
    Experiment(resolve_config(None, "quickstart", sets)).run(tmp_path, progress=False)
    rows = _metrics(tmp_path)
    for alg in ("fedavg", "dcfl"):
        mine = [r for r in rows if r["algorithm"] == alg]
        eps = [float(r["epsilon"]) for r in mine]
        assert eps == sorted(eps) and eps[0] > 0.0
        assert max(eps) <= 2.0 and eps[-1] > 2.0 - 0.02  # the budget is used up, not exceeded
        # after 3 uploads no client can release any more: the job stops with a message
        assert [int(r["round"]) for r in mine] == [1, 2, 3]
        assert [int(r["rejected"]) for r in mine] == [0, 0, 0]
    local = [float(r["epsilon"]) for r in rows if r["algorithm"] == "local"]
    assert local == [0.0] * 5  # local training releases nothing


def test_withheld_uploads_are_not_sent(tmp_path):
    """A client out of budget withholds its upload: no bytes up, a ``withheld`` event,
    no rejection; the others go on."""
    sets = [
        *TINY,
        "rounds=3",
        "participation={count: 4}",
        "algorithms=[{name: fedavg}]",
        "privacy={mode: client, epsilon: 2.0, clip: 0.5, max_participations: 1}",
    ]
    config = resolve_config(None, "quickstart", sets)
    Experiment(config).run(tmp_path, progress=False)
    with open(tmp_path / "events.csv", newline="") as f:
        withheld = [r for r in csv.DictReader(f) if r["kind"] == "withheld"]
    rows = _metrics(tmp_path)
    assert withheld and all(int(r["rejected"]) == 0 for r in rows)
    d = int(rows[0]["bytes_down"]) // 4 // 4  # 4 clients get the model each round
    for r in rows:
        held_back = sum(1 for w in withheld if w["round"] == r["round"])
        sent = 4 - held_back
        assert int(r["bytes_up"]) == sent * (d * 4 + 4)  # model and sample count


def test_record_level_run_and_resume_keep_the_ledger(tmp_path):
    sets = [
        *TINY,
        "rounds=3",
        "algorithms=[{name: fedavg}]",
        "privacy={mode: record, epsilon: 4.0, clip: 1.0}",
    ]
    config = resolve_config(None, "quickstart", sets)
    Experiment(config).run(tmp_path / "full", progress=False)
    full = [float(r["epsilon"]) for r in _metrics(tmp_path / "full")]
    assert full == sorted(full) and full[0] > 0.0 and full[-1] <= 4.0
    assert full[-1] > 4.0 - 0.02  # every round: the worst case σ was calibrated for
    Experiment(config).run(tmp_path / "cut", progress=False, stop_after_round=2)
    Experiment(config).run(tmp_path / "cut", resume=True, progress=False)
    resumed = _metrics(tmp_path / "cut")
    assert [float(r["epsilon"]) for r in resumed] == full
    assert [r["accuracy"] for r in resumed] == [r["accuracy"] for r in _metrics(tmp_path / "full")]


def test_no_privacy_leaves_the_column_empty(tmp_path):
    sets = [*TINY, "rounds=1", "algorithms=[{name: fedavg}]"]
    Experiment(resolve_config(None, "quickstart", sets)).run(tmp_path, progress=False)
    assert _metrics(tmp_path)[0]["epsilon"] == ""


# --------------------------------------------------------------------- config
def test_privacy_config_is_validated():
    for bad, field in [
        ("privacy.mode=both", "privacy.mode"),
        ("privacy.epsilon=0", "privacy.epsilon"),
        ("privacy.delta=1.5", "privacy.delta"),
        ("privacy.max_participations=0", "privacy.max_participations"),
        ("privacy.noise=1", "privacy.noise"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            resolve_config(None, "quickstart", [bad])


def test_max_participations_options():
    base = ["rounds=10", "participation.fraction=0.25"]
    cfg = resolve_config(None, "quickstart", [*base, "privacy.max_participations=expected"])
    assert max_participations(cfg, 24) == 3  # ⌈10 × 0.25⌉
    cfg = resolve_config(None, "quickstart", base)
    assert max_participations(cfg, 24) == 10  # every round, the worst case
    cfg = resolve_config(None, "quickstart", [*base, "privacy.max_participations=4"])
    assert max_participations(cfg, 24) == 4
