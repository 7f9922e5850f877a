"""The channel guards every reply kind: failures, malformed payloads, byte counting, local DP.

For each client computation (training, the K-model losses, JGL's gradient
products, CFLGT's trajectory, evaluation) one client fails, one replies with
NaN and one with an oversized payload, through the same per-client assembly
the Flower backend uses (:func:`fedcluster.protocol.computation.assemble`).
The channel must log and count them, never hand them to the algorithm, and
count bytes from the payloads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.cflgt import TRAJECTORY
from fedcluster.algorithms.jgl import GRADIENT_PRODUCTS
from fedcluster.engine.client_computations import EVALUATE, LOSSES, TRAIN
from fedcluster.privacy.ledger import LocalDP
from fedcluster.protocol.batches import LocalTraining
from fedcluster.protocol.channel import INT_BYTES, Channel
from fedcluster.protocol.computation import ClientComputation, Request, Returned, assemble
from tests.helpers import FLOAT_BYTES, make_context, rotated_digits

FAILING, NAN, OVERSIZED = 1, 2, 4
N = 6
CFG = LocalTraining(lr=0.1, batch_size=16)


class Tampering:
    """A backend whose clients ``NAN`` and ``OVERSIZED`` send a NaN / one-too-long field."""

    def __init__(self, inner, field: str) -> None:
        self.inner, self.field = inner, field
        self.federation, self.layout, self.model = inner.federation, inner.layout, inner.model
        self.seconds = 0.0

    def run(self, computation: ClientComputation, clients, request: Request) -> Returned:
        fields = self.inner.run(computation, clients, request).fields
        replies = [{k: v[i].clone() for k, v in fields.items()} for i in range(len(clients))]
        for i, c in enumerate(clients):
            value = replies[i][self.field]
            if c == NAN:
                replies[i][self.field] = torch.full_like(value, float("nan"))
            if c == OVERSIZED:
                replies[i][self.field] = torch.cat([value.reshape(-1), value.reshape(-1)[:1]])
        return assemble(computation, request, replies)


@pytest.fixture(scope="module")
def federation():
    return rotated_digits(n_groups=2, clients_per_group=N // 2, per_client=40)


def _channel(federation, field: str) -> tuple[Channel, torch.Tensor]:
    ctx = make_context(federation, hidden=[16], train=CFG)
    channel = Channel(Tampering(ctx.channel.backend, field), seed=0)
    failing = np.zeros(N, dtype=bool)
    failing[FAILING] = True
    channel.start_round(failing=failing)
    return channel, ctx.init_row


def _requests(row: torch.Tensor) -> dict[str, tuple[ClientComputation, Request, str]]:
    models = torch.stack([row, row * 0.5])
    settings = {"train": CFG, "round": 1, "purpose": "decide"}
    return {
        "training": (
            TRAIN,
            Request(shared={"start": row}, settings={"train": CFG, "round": 1}),
            "row",
        ),
        "losses": (LOSSES, Request(shared={"models": models}, settings=settings), "losses"),
        "products": (
            GRADIENT_PRODUCTS,
            Request(shared={"models": models, "directions": models - row}, settings=settings),
            "dot",
        ),
        "trajectory": (
            TRAJECTORY,
            Request(
                shared={"model": row}, settings={"normalise": True, "n_classes": 10, "round": 1}
            ),
            "trajectory",
        ),
    }


@pytest.mark.parametrize("kind", ["training", "losses", "products", "trajectory"])
def test_the_channel_guards_every_reply_kind(federation, kind):
    field = _requests(torch.zeros(1))[kind][2]
    channel, row = _channel(federation, field)
    computation, request, _ = _requests(row)[kind]
    clients = np.arange(N)
    replies = channel.ask(computation, clients, request, rnd=1, metadata_ints=1)

    assert replies.clients.tolist() == [0, 3, 5]  # never aggregated or clustered
    assert channel.failed == [FAILING]
    assert sorted(channel.rejected) == [NAN, OVERSIZED]
    kinds = {(c, k) for c, k, _ in channel.events}
    assert kinds == {(FAILING, "failed"), (NAN, "rejected"), (OVERSIZED, "rejected")}
    assert any("shape" in detail for c, _, detail in channel.events if c == OVERSIZED)
    for value in replies.fields.values():
        assert len(value) == 3 and torch.isfinite(value.double()).all()

    # Down: every asked client received the request's tensors.
    per_client_down = sum(t.numel() * t.element_size() for t in request.shared.values())
    assert channel.traffic.down == N * per_client_down
    # Up: what came back. The 4 well-formed replies (the NaN one included: it was sent)
    # each carry the declared upload fields and one metadata integer; the oversized one
    # its upload field one element longer.
    declared = sum(
        int(np.prod(f.shape_for(request))) * torch.empty(0, dtype=f.dtype).element_size()
        for f in computation.reply.values()
        if f.counted
    )
    spec = computation.reply[field]
    oversized = declared + torch.empty(0, dtype=spec.dtype).element_size() if spec.counted else 0
    assert channel.traffic.up == 4 * (declared + INT_BYTES) + oversized
    if kind in ("losses", "products"):  # decision queries: the device decides (documented)
        assert declared == 0 and computation.exempt_because
    if kind == "training":
        assert declared == len(row) * FLOAT_BYTES
    assert channel.measured.up == channel.measured.down == 0


def test_evaluation_is_a_measurement_that_still_rejects_bad_replies(federation):
    """Evaluation is the experimenter's oracle: a failing client is still evaluated
    (documented exemption), but a NaN or oversized reply is rejected and left out,
    and its traffic is counted apart from the round's."""
    channel, row = _channel(federation, "loss_sum")
    models = torch.stack([row, row * 0.5])
    index = torch.tensor([0, 1, 0, 1, 0, 1])
    request = Request(
        shared={"models": models},
        own={"model_index": index},
        settings={"split": "test"},
        pick={"model": ("models", "model_index")},
    )
    replies = channel.ask(EVALUATE, np.arange(N), request, rnd=1, measurement=True)
    assert replies.clients.tolist() == [0, 1, 3, 5]  # the failing client 1 answers a measurement
    assert sorted(channel.rejected) == [NAN, OVERSIZED] and channel.failed == []
    assert channel.traffic.up == channel.traffic.down == 0
    assert channel.measured.down == N * len(row) * FLOAT_BYTES  # each client gets its one model
    assert channel.measured.up == 5 * 24 + (24 + 8)  # 5 replies; the oversized one 8 more


def test_the_evaluation_bounds_reject_impossible_counts(federation):
    ctx = make_context(federation, hidden=[16], train=CFG)
    request = Request(
        shared={"models": ctx.init_row.unsqueeze(0)},
        own={"model_index": torch.zeros(N, dtype=torch.int64)},
        pick={"model": ("models", "model_index")},
    )
    reply = EVALUATE.run(ctx.channel.backend, np.arange(N), request)
    reply["correct"][3] = reply["count"][3] + 1
    assert EVALUATE.check is not None
    reasons = EVALUATE.check(request, reply)
    assert [i for i, r in enumerate(reasons) if r] == [3]


def test_cflgt_trajectories_are_privatised_and_accounted(federation):
    """Client-level local DP: the trajectory is clipped to C, noised where the client is,
    and the release enters the ledger (ε grows); record level refuses the release."""
    ctx = make_context(federation, hidden=[16], train=CFG)
    backend = ctx.channel.backend
    sizes = backend.federation.train_sizes
    clip = 1e-3

    def ledger(mode: str, sigma: float) -> LocalDP:
        return LocalDP(
            mode,
            seed=0,
            clip=clip,
            delta=1e-5,
            noise_multiplier=np.full(N, sigma),
            sample_rate=np.ones(N),
            budget=np.full(N, 3),
        )

    request = _requests(ctx.init_row)["trajectory"][1]
    raw = TRAJECTORY.run(backend, np.arange(N), request)["trajectory"]
    assert (raw.flatten(1).norm(dim=1) > clip).all()

    silent = ledger("client", 0.0)  # σ = 0: only the clipping shows
    channel = Channel(backend, seed=0, privacy=silent)
    clipped = channel.ask(TRAJECTORY, np.arange(N), request, rnd=1)["trajectory"]
    norms = clipped.flatten(1).norm(dim=1)
    assert torch.allclose(norms, torch.full_like(norms, clip), rtol=1e-5)
    cos = torch.nn.functional.cosine_similarity(clipped.flatten(1), raw.flatten(1), dim=1)
    assert torch.allclose(cos, torch.ones_like(cos), atol=1e-5)
    assert silent.releases.tolist() == [1] * N and silent.steps.tolist() == [1] * N

    noisy = ledger("client", 2.0)
    channel = Channel(backend, seed=0, privacy=noisy)
    released = channel.ask(TRAJECTORY, np.arange(N), request, rnd=1)["trajectory"]
    noise = (released - clipped).flatten()
    assert noise.std().item() == pytest.approx(2.0 * clip, rel=0.15)  # σ·C per coordinate
    assert noisy.max_epsilon() > 0

    with pytest.raises(Exception, match="record-level DP cannot release"):
        Channel(backend, seed=0, privacy=ledger("record", 1.0)).ask(
            TRAJECTORY, np.arange(N), request, rnd=1
        )
    assert int(sizes.min()) > 0
