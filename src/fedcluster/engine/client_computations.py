"""The client computations several algorithms share: train, the K-model losses, evaluate.

Each is a :class:`~fedcluster.protocol.computation.ClientComputation` whose
batched form uses only its :class:`~fedcluster.protocol.client_side.ClientBatch`
(``train``, ``evaluate_models``, ``evaluate``, ``losses_and_grads``: the helpers a
:class:`~fedcluster.protocol.client_side.ClientContext` offers one client, for many):
the simulator's kernels for many clients at once, a Flower node's one-client
simulator for its client. Algorithm-specific computations live with
their algorithm (JGL's gradient products in :mod:`fedcluster.algorithms.jgl`,
CFLGT's trajectory in :mod:`fedcluster.algorithms.cflgt`).

Settings (``Request.settings``): ``train`` (a
:class:`~fedcluster.protocol.batches.LocalTraining`), ``round`` and
``purpose`` (they seed the client's random streams).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from fedcluster.privacy.mechanisms import release_uploads, release_vectors
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    Release,
    ReplyField,
    Request,
    register_computation,
)


def _model_dim(request: Request) -> tuple[int, ...]:
    start = request.own.get("start", request.shared.get("start"))
    assert start is not None
    return (start.shape[-1],)


def _train(batch: ClientBatch, request: Request) -> Payload:
    s = request.settings
    start = request.own["start"] if "start" in request.own else request.shared["start"]
    result = batch.train(
        start,
        s["train"],
        s["round"],
        s.get("purpose", "train"),
        classifier_only=bool(s.get("classifier_only", False)),
    )
    return {"row": result.rows, "loss": result.loss, "steps": result.steps}


def release_trained(
    request: Request, reply: Payload, clients: np.ndarray, seed: int, start: torch.Tensor
) -> Payload:
    """Local DP of the models ``reply["row"]`` trained from ``start`` [n, d]
    (:func:`fedcluster.privacy.mechanisms.release_uploads`), where the client is."""
    assert request.own_settings is not None
    tickets = [s["ticket"] for s in request.own_settings]
    rows = release_uploads(
        tickets, clients, start, reply["row"], reply["steps"], seed, request.settings["round"]
    )
    return {**reply, "row": rows}


def release_chosen(request: Request, reply: Payload, clients: np.ndarray, seed: int) -> Payload:
    """Local DP of the model each client trained from the cluster model it chose (the
    request's shared ``models``, the reply's ``cluster``), where the client is."""
    start = request.shared["models"][reply["cluster"].long()]
    return release_trained(request, reply, clients, seed, start)


def vector_release(field: str, purpose: str) -> Release:
    """The local-DP release of a reply whose ``field`` is one vector per client (CFLGT's
    trajectory, PACFL's subspace): client-level clipping and Gaussian noise where the
    client is (:func:`fedcluster.privacy.mechanisms.release_vectors`), its noise stream named
    ``purpose``."""

    def release(request: Request, reply: Payload, clients: np.ndarray, seed: int) -> Payload:
        assert request.own_settings is not None
        tickets = [s["ticket"] for s in request.own_settings]
        rnd = int(request.settings["round"])
        return {**reply, field: release_vectors(tickets, clients, reply[field], seed, rnd, purpose)}

    return release


def _release_training(request: Request, reply: Payload, clients: np.ndarray, seed: int) -> Payload:
    """Local DP of a model trained from the received start row."""
    start = request.rows("start", np.arange(len(clients)))
    return release_trained(request, reply, clients, seed, start)


TRAIN = register_computation(
    ClientComputation(
        name="train",
        reply={
            "row": ReplyField(_model_dim),
            "loss": ReplyField((), counted=False, finite=False),
            "steps": ReplyField((), counted=False, dtype=torch.int64),
        },
        batched_run=_train,
        privacy="release",
        release=_release_training,
        update=("row", "start"),
        release_cost="steps",
    )
)
"""Local SGD from the received start row (FedAvg's ClientUpdate; FedProx's proximal
term, momentum, DP-SGD or classifier-only fine-tuning from the settings). Uploads
the trained model; the loss and step count are instrumentation."""


def cluster_ids_in_range(
    models: str,
) -> Callable[[Request, Payload], list[str | None]]:
    """The check of a reply's ``cluster`` ids (one per client) against the K rows of the
    request's shared ``models`` field: why each id is out of range, None where it is not."""

    def check(request: Request, reply: Payload) -> list[str | None]:
        k = request.shared[models].shape[0]
        return [
            None if 0 <= c < k else f"cluster id {c} outside 0..{k - 1}"
            for c in reply["cluster"].tolist()
        ]

    return check


def chosen_start_training(
    name: str,
    batched_run: Callable[[ClientBatch, Request], Payload],
    extra_reply: dict[str, ReplyField] | None = None,
) -> ClientComputation:
    """A training whose client chooses its start among the request's shared ``models``
    and reports the choice as ``cluster`` (JGL's and IFCA's choose-and-train, DCFL's and
    FedGroup's direction choice): :data:`TRAIN`'s reply, DP release, cost and update
    bound, taken from the chosen model, and the cluster ids checked against K."""
    return replace(
        TRAIN,
        name=name,
        reply={
            **TRAIN.reply,
            "row": ReplyField(lambda r: (r.shared["models"].shape[1],)),
            "cluster": ReplyField((), dtype=torch.int32),
            **(extra_reply or {}),
        },
        batched_run=batched_run,
        release=release_chosen,
        update=("row", "models"),
        start_index="cluster",
        check=cluster_ids_in_range("models"),
    )


def n_models(request: Request) -> tuple[int, ...]:
    """The reply shape of a query about the K received ``models``: (K,)."""
    return (request.shared["models"].shape[0],)


def _losses(batch: ClientBatch, request: Request) -> Payload:
    s = request.settings
    models = request.shared["models"]
    if s.get("batches", "one") == "all":  # IFCA's full-data choice: all K in one pass
        _, count, loss_sum = batch.evaluate_models(models, split="train")
        return {"losses": torch.as_tensor(loss_sum / np.maximum(count, 1)[:, None]).float()}
    losses, _ = batch.losses_and_grads(
        models, s["train"], s["round"], s.get("purpose", "decide"), with_grads=False
    )
    return {"losses": losses}


DECISION_EXEMPTION = (
    "a decision query: in the papers' protocols the device compares the K models "
    "itself and uploads only its choice, counted with its model (IFCA Alg. 1, JGL Alg. 1); "
    "the simulator makes the choice beside the server to batch it, so the reply is "
    "neither privatised nor counted in bytes_up"
)

LOSSES = register_computation(
    ClientComputation(
        name="losses",
        reply={"losses": ReplyField(n_models, counted=False)},
        batched_run=_losses,
        exempt_because=DECISION_EXEMPTION,
    )
)
"""The loss of each of K received models on one mini-batch of the client's training
data (``batches: all``: on all of it): IFCA's cluster identity estimate."""


def _evaluate(batch: ClientBatch, request: Request) -> Payload:
    models = request.shared["models"] if "models" in request.shared else request.own["model"]
    index = request.own["model_index"] if "models" in request.shared else torch.arange(len(models))
    result = batch.evaluate(models, index.numpy(), request.settings.get("split", "test"))
    return {
        "correct": torch.as_tensor(result.correct),
        "count": torch.as_tensor(result.count),
        "loss_sum": torch.as_tensor(result.loss_sum),
    }


def _evaluation_bounds(request: Request, reply: Payload) -> list[str | None]:
    """Correct predictions and the loss cannot exceed what the sample count allows
    (for each model, where a client reports on several)."""
    out: list[str | None] = []
    for correct, count, loss in zip(
        reply["correct"].tolist(), reply["count"].tolist(), reply["loss_sum"].tolist(), strict=True
    ):
        corrects = correct if isinstance(correct, list) else [correct]
        losses = loss if isinstance(loss, list) else [loss]
        if count < 0 or not all(0 <= c <= count for c in corrects) or min(losses) < 0:
            out.append(f"evaluation out of bounds (correct {correct}, count {count}, loss {loss})")
        else:
            out.append(None)
    return out


MEASUREMENT = (
    "measurement: the experimenter's test of the model a client would use, "
    "not part of any algorithm's protocol (its traffic is counted apart)"
)


EVALUATE = register_computation(
    ClientComputation(
        name="evaluate",
        reply={
            "correct": ReplyField((), dtype=torch.int64),
            "count": ReplyField((), dtype=torch.int64, samples=True),
            "loss_sum": ReplyField((), dtype=torch.float64),
        },
        batched_run=_evaluate,
        exempt_because=MEASUREMENT,
        check=_evaluation_bounds,
    )
)
"""Correct predictions, sample count and summed loss of the model each client uses
(``models`` shared with one index per client: a client receives only its model)."""


def _evaluate_models(batch: ClientBatch, request: Request) -> Payload:
    correct, count, loss_sum = batch.evaluate_models(
        request.shared["models"], request.settings.get("split", "test")
    )
    return {
        "correct": torch.as_tensor(correct),
        "count": torch.as_tensor(count),
        "loss_sum": torch.as_tensor(loss_sum),
    }


EVALUATE_MODELS = register_computation(
    ClientComputation(
        name="evaluate_models",
        reply={
            "correct": ReplyField(n_models, dtype=torch.int64),
            "count": ReplyField((), dtype=torch.int64, samples=True),
            "loss_sum": ReplyField(n_models, dtype=torch.float64),
        },
        batched_run=_evaluate_models,
        exempt_because=MEASUREMENT,
        check=_evaluation_bounds,
    )
)
"""Correct predictions [K], sample count and summed losses [K] of each of the K received
``models`` on the client's data (IFCA's own-loss test protocol: every model, one pass)."""


LOSS_VECTORS = register_computation(
    ClientComputation(
        name="loss-vectors",
        reply={"losses": ReplyField(n_models)},
        batched_run=_losses,
        privacy="release",
        release=vector_release("losses", "loss-vector"),
    )
)
"""The same K losses as :data:`LOSSES`, uploaded to the server as the client's embedding
(CLoVE clusters them there): counted in ``bytes_up`` and released under local DP
(clipped and noised where the client is) like any vector upload."""
