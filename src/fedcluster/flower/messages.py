"""What the Flower ServerApp and ClientApp say to each other (Flower's Message API).

Every registered client computation (:mod:`fedcluster.protocol.computation`)
travels the same way: message type ``train``, ``evaluate`` or ``query`` (the
others), the computation's name and module in the settings. A node may hold
several clients; the server sends it **one message per call for all its
clients asked** (:func:`encode_clients`): the settings list their global ids
(``clients``), the tensors every client receives travel once
(``"arrays"``: ``shared/<name>``, an ``ArrayRecord``), and client ``j`` of the
message has its own tensors and settings under the prefix ``j|``
(``j|own/<name>``; ``j|<setting>`` in ``"config"``, a ``ConfigRecord``: a
:class:`LocalTraining` and a release rule flattened under their key). The
node runs each client on its own (:func:`split_clients` gives each one's
request) and replies with each client's declared reply fields under the
same prefix, or ``j|error``: that client's error, so one broken client does
not fail the others (:func:`encode_replies`, :func:`decode_replies`).
Besides them, ``query.setup`` asks a node for its clients' ids, sample
counts, groups and data shape.

Every request's config names the experiment (its YAML text and seed), so a
node can build its data and model from it (and cache them), plus the round
and the purpose that seed the client's random streams:
a node computes exactly what the simulator computes for that client.

Under local differential privacy the noise is drawn on the node: a
``train`` request carries the client's DP-SGD settings (record level: C, σ_i,
its release counter) and, for an upload, its release rule
(:class:`~fedcluster.privacy.mechanisms.UploadTicket`: client level clips and noises the
upload on the node; either level withholds an upload its budget does not
allow). The server keeps the ledger.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedcluster.data.drift import DriftEvent
from fedcluster.privacy.mechanisms import RecordDP, UploadTicket
from fedcluster.protocol.batches import LocalTraining
from fedcluster.protocol.computation import Request, Settings

SETUP = "query.setup"
CLIENTS = "clients"
ERROR = "error"

_TRAINING_FIELDS = ("lr", "batch_size", "epochs", "momentum", "mu", "augment", "lr_decay")
SHARED, OWN = "shared/", "own/"


def message_type(computation: str) -> str:
    """Flower's message type of a computation: ``train`` and ``evaluate`` by their
    own names, every other one a ``query`` (the name travels in the settings)."""
    return computation if computation in ("train", "evaluate") else "query"


def training_config(cfg: LocalTraining, client: int) -> dict[str, Any]:
    """How to train (``cfg``, ``steps`` absent when unset; DP-SGD's clip, batch
    sampling and this client's σ and release counter when on) as ConfigRecord values."""
    values = {k: v for k, v in asdict(cfg).items() if k in _TRAINING_FIELDS}
    if cfg.steps is not None:
        values["steps"] = int(cfg.steps)
    if cfg.dp is not None:
        values.update(
            dp_clip=float(cfg.dp.clip),
            dp_poisson=bool(cfg.dp.poisson),
            dp_sigma=cfg.dp.sigma(client),
            dp_release=cfg.dp.releases(client),
        )
    return values


def training_from(config: Mapping[str, Any]) -> LocalTraining:
    """The :class:`LocalTraining` that :func:`training_config` encoded."""
    steps = config.get("steps")
    dp = None
    if "dp_clip" in config:
        dp = RecordDP(
            clip=float(config["dp_clip"]),
            noise_multiplier=(float(config.get("dp_sigma", 0.0)),),
            poisson=bool(config["dp_poisson"]),
            release=int(config.get("dp_release", 0)),
        )
    return LocalTraining(
        lr=float(config["lr"]),
        batch_size=int(config["batch_size"]),
        epochs=int(config["epochs"]),
        steps=None if steps is None else int(steps),
        momentum=float(config["momentum"]),
        mu=float(config["mu"]),
        dp=dp,
        augment=str(config.get("augment", "none")),
        lr_decay=float(config.get("lr_decay", 1.0)),
    )


def encode_settings(settings: Settings, client: int) -> dict[str, Any]:
    """A computation's settings as ConfigRecord values for client ``client`` (global id):
    a :class:`LocalTraining` and an :class:`UploadTicket` are flattened under their key."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, LocalTraining):
            out.update({f"{key}.{k}": v for k, v in training_config(value, client).items()})
        elif isinstance(value, UploadTicket):
            out.update({f"{key}:{k}": v for k, v in asdict(value).items()})
        else:
            out[key] = value
    return out


def decode_settings(config: Mapping[str, Any]) -> Settings:
    """The settings :func:`encode_settings` flattened."""
    out: Settings = {}
    nested: dict[str, dict[str, Any]] = {}
    tickets: dict[str, dict[str, Any]] = {}
    for key, value in config.items():
        if "." in key:
            head, _, field = key.partition(".")
            nested.setdefault(head, {})[field] = value
        elif ":" in key:
            head, _, field = key.partition(":")
            tickets.setdefault(head, {})[field] = value
        else:
            out[key] = value
    out.update({k: training_from(v) for k, v in nested.items()})
    for key, v in tickets.items():
        out[key] = UploadTicket(
            mode="record" if v["mode"] == "record" else "client",
            clip=float(v["clip"]),
            noise_multiplier=float(v["noise_multiplier"]),
            release=int(v["release"]),
            remaining=int(v["remaining"]),
        )
    return out


def encode_request(request: Request) -> dict[str, torch.Tensor]:
    """One client's tensors (``request.client(i)``): shared ones and its own rows."""
    arrays = {SHARED + k: v for k, v in request.shared.items()}
    arrays.update({OWN + k: v[0] for k, v in request.own.items()})
    return arrays


def decode_request(arrays: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Request:
    """A one-client request from a message's tensors and settings."""
    own_config = {k[len(OWN) :]: v for k, v in config.items() if k.startswith(OWN)}
    shared_config = {k: v for k, v in config.items() if not k.startswith(OWN)}
    return Request(
        shared={k[len(SHARED) :]: v for k, v in arrays.items() if k.startswith(SHARED)},
        own={k[len(OWN) :]: v.unsqueeze(0) for k, v in arrays.items() if k.startswith(OWN)},
        settings=decode_settings(shared_config),
        own_settings=(decode_settings(own_config),) if own_config else None,
    )


def prefix(j: int) -> str:
    """The key prefix of the ``j``-th client of a message."""
    return f"{j}|"


def encode_clients(
    request: Request, positions: Sequence[int], clients: Sequence[int]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One node's message for the asked clients at ``positions`` of ``request`` (global
    ids ``clients``): the shared tensors once, each client's own tensors and settings
    under its prefix, the ids under ``clients``."""
    arrays: dict[str, torch.Tensor] = {}
    config: dict[str, Any] = {CLIENTS: [int(c) for c in clients]}
    for j, (i, c) in enumerate(zip(positions, clients, strict=True)):
        one = request.client(int(i))
        for key, value in encode_request(one).items():
            if key.startswith(SHARED):
                arrays[key] = value  # the same for every client of the request
            else:
                arrays[prefix(j) + key] = value
        for key, value in encode_settings(one.settings, int(c)).items():
            config[prefix(j) + key] = value
        own = one.own_settings[0] if one.own_settings else {}
        for key, value in encode_settings(own, int(c)).items():
            config[prefix(j) + OWN + key] = value
    return arrays, config


def split_clients(
    arrays: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> list[tuple[int, Request]]:
    """Each client's (global id, one-client request) of a message :func:`encode_clients` made."""
    shared = {k: v for k, v in arrays.items() if k.startswith(SHARED)}
    out = []
    for j, client in enumerate(config[CLIENTS]):
        head = prefix(j)
        own = {k[len(head) :]: v for k, v in arrays.items() if k.startswith(head)}
        settings = {k[len(head) :]: v for k, v in config.items() if k.startswith(head)}
        out.append((int(client), decode_request({**shared, **own}, settings)))
    return out


def encode_replies(replies: Sequence[Mapping[str, torch.Tensor] | str]) -> RecordDict:
    """A node's reply for the clients of one message, in their order: each client's
    reply fields, or its error (a string)."""
    arrays: dict[str, torch.Tensor] = {}
    config: dict[str, Any] = {}
    for j, one in enumerate(replies):
        if isinstance(one, str):
            config[prefix(j) + ERROR] = one
        else:
            arrays.update({prefix(j) + k: v for k, v in one.items()})
    return request(arrays, config)


def decode_replies(content: RecordDict, n: int) -> list[dict[str, torch.Tensor] | str]:
    """The ``n`` clients' replies :func:`encode_replies` packed: fields, or the
    client's error prefixed ``node error:``."""
    arrays, config = tensors(content), settings(content)
    out: list[dict[str, torch.Tensor] | str] = []
    for j in range(n):
        head = prefix(j)
        if head + ERROR in config:
            out.append(f"node error: {' '.join(str(config[head + ERROR]).split())}")
        else:
            out.append({k[len(head) :]: v for k, v in arrays.items() if k.startswith(head)})
    return out


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


def integer(config: Mapping[str, Any], key: str) -> int:
    """The integer setting ``key`` of a request (one line naming it if it is not one)."""
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"message setting {key!r} must be an integer, not {value!r}")
    return value


DRIFT = "drift"
"""Settings key of a message's drift events: ``{client id: [event, ...]}`` as JSON."""


def encode_drift(events: Mapping[int, Sequence[DriftEvent]]) -> str:
    """The drift events of a message's clients (each client's events of the job so
    far, in order) as one ConfigRecord string."""
    return json.dumps(
        {
            str(c): [
                {k: v for k, v in asdict(e).items() if k not in ("client", "regroup")}
                for e in client_events
            ]
            for c, client_events in events.items()
        }
    )


def decode_drift(text: str) -> dict[int, list[DriftEvent]]:
    """The events :func:`encode_drift` wrote, each for its client."""
    out: dict[int, list[DriftEvent]] = {}
    for c, client_events in json.loads(text).items():
        out[int(c)] = [
            DriftEvent(**{**e, "client": int(c), "labels": e["labels"] and tuple(e["labels"])})
            for e in client_events
        ]
    return out
