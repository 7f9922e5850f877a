"""What the Flower ServerApp and ClientApp say to each other (Flower's Message API).

Every client computation of :class:`~fedcluster.engine.simulator.Simulator`
that an algorithm calls is one message type; a request carries the tensors
the client needs (``"arrays"``, an ``ArrayRecord``) and the settings
(``"config"``, a ``ConfigRecord``), the reply carries the result tensors:

- ``query.setup``: nothing -> the client's id, sample counts, group, data shape;
- ``train``: ``start`` [d] -> ``row`` [d], ``loss``, ``steps`` (local SGD);
- ``query.losses``: ``models`` [K, d] -> ``losses`` [K] and ``grads`` [K, d];
- ``query.products``: ``models``, ``directions`` [K, d] -> ``losses``, ``sq``, ``dot`` [K];
- ``query.trajectory``: ``start`` [d] -> ``trajectory`` [C, 2] (CFLGT);
- ``evaluate``: ``model`` [d] -> ``correct``, ``count``, ``loss_sum``.

Every request's config names the experiment (its YAML text and seed), so a
node can build its data and model from it (and cache them), plus the round
and the purpose that seed the client's random streams (DESIGN principle 4):
a node computes exactly what the simulator computes for that client.

Under local differential privacy the noise is drawn on the node: a
``train`` request carries the client's DP-SGD settings (record level: C, σ_i,
its release counter) and, for an upload, its release rule
(:class:`~fedcluster.privacy.UploadTicket`: client level clips and noises
the update on the node; either level withholds an upload its budget does
not allow). The server keeps the ledger.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedcluster.engine.batches import LocalTraining
from fedcluster.privacy import RecordDP, UploadTicket

SETUP = "query.setup"
TRAIN = "train"
LOSSES = "query.losses"
PRODUCTS = "query.products"
TRAJECTORY = "query.trajectory"
EVALUATE = "evaluate"

_TRAINING_FIELDS = ("lr", "batch_size", "epochs", "momentum", "mu")


def training_config(cfg: LocalTraining, rnd: int, purpose: str) -> dict[str, Any]:
    """How to train (``cfg``, ``steps`` absent when unset; DP-SGD's clip and batch
    sampling when on) and which random stream to draw batches from (round,
    purpose), as ConfigRecord values."""
    values = {k: v for k, v in asdict(cfg).items() if k in _TRAINING_FIELDS}
    if cfg.steps is not None:
        values["steps"] = int(cfg.steps)
    if cfg.dp is not None:
        values.update(dp_clip=float(cfg.dp.clip), dp_poisson=bool(cfg.dp.poisson))
    return {**values, "round": rnd, "purpose": purpose}


def client_dp_config(dp: RecordDP, client: int) -> dict[str, Any]:
    """One client's DP-SGD noise: its σ and release counter (a ``train`` request)."""
    return {"dp_sigma": dp.sigma(client), "dp_release": dp.releases(client)}


def training_from(config: ConfigRecord) -> tuple[LocalTraining, int, str]:
    """The ``(cfg, round, purpose)`` that :func:`training_config` and
    :func:`client_dp_config` encoded."""
    steps = config.get("steps")
    dp = None
    if "dp_clip" in config:
        dp = RecordDP(
            clip=float(config["dp_clip"]),
            noise_multiplier=(float(config.get("dp_sigma", 0.0)),),
            poisson=bool(config["dp_poisson"]),
            release=int(config.get("dp_release", 0)),
        )
    cfg = LocalTraining(
        lr=float(config["lr"]),
        batch_size=int(config["batch_size"]),
        epochs=int(config["epochs"]),
        steps=None if steps is None else int(steps),
        momentum=float(config["momentum"]),
        mu=float(config["mu"]),
        dp=dp,
    )
    return cfg, int(config["round"]), str(config["purpose"])


def ticket_config(ticket: UploadTicket) -> dict[str, Any]:
    """An upload's release rule as ConfigRecord values."""
    return {f"upload_{k}": v for k, v in asdict(ticket).items()}


def ticket_from(config: ConfigRecord) -> UploadTicket | None:
    """The release rule :func:`ticket_config` encoded (None: no local DP)."""
    if "upload_mode" not in config:
        return None
    return UploadTicket(
        mode="record" if config["upload_mode"] == "record" else "client",
        clip=float(config["upload_clip"]),
        noise_multiplier=float(config["upload_noise_multiplier"]),
        release=int(config["upload_release"]),
        remaining=int(config["upload_remaining"]),
    )


def request(arrays: dict[str, torch.Tensor], config: dict[str, Any]) -> RecordDict:
    """A request's content: tensors and settings."""
    return RecordDict(
        {
            "arrays": ArrayRecord({k: v.detach().contiguous() for k, v in arrays.items()}),
            "config": ConfigRecord(config),
        }
    )


def reply(arrays: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> RecordDict:
    """A reply's content: result tensors (and, for ``setup``, settings)."""
    return request(arrays, config or {})


def tensors(content: RecordDict) -> dict[str, torch.Tensor]:
    """The tensors of a request or reply."""
    record = content["arrays"]
    assert isinstance(record, ArrayRecord)
    return dict(record.to_torch_state_dict())


def settings(content: RecordDict) -> ConfigRecord:
    """The settings of a request or reply."""
    record = content["config"]
    assert isinstance(record, ConfigRecord)
    return record
