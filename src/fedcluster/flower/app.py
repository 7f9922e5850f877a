"""``fedcluster flower app``: an experiment as a Flower App that ``flwr run`` ships.

A Flower App is a folder with a ``pyproject.toml`` naming its ServerApp and
ClientApp (``[tool.flwr.app.components]``) and its settings
(``[tool.flwr.app.config]``, Flower's *run config*), as in Flower's
quickstart-pytorch example. ``flwr run DIR <superlink>`` packs the folder
into a FAB (with ``experiment.yaml``: Flower includes ``*.yaml``), sends it
to the SuperLink, which starts the ServerApp; each SuperNode's ClientApp
receives the requests. Both components are fedcluster's
(``fedcluster.flower.server:server_app``, ``fedcluster.flower.client:client_app``),
so ``fedcluster[flower]`` must be installed where the SuperLink and the
SuperNodes run.

Run config keys (override with ``flwr run DIR <superlink> -c 'key=value'``):

- ``config``: the experiment YAML, relative to the app folder (or absolute);
- ``preset``: a preset name (used when ``config`` is empty);
- ``out``: the run directory, on the SuperLink's machine;
- ``round-timeout``: seconds to wait for a request's replies (0: the YAML's
  ``deployment.round_timeout``);
- ``min-replies``: fraction of the clients asked that must reply (0: the
  YAML's ``deployment.min_replies``).

:func:`config_from_run` turns a run config into the experiment the
ServerApp runs (:func:`fedcluster.flower.server._deployed`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedcluster.config import ExperimentConfig, dump_config, resolve_config
from fedcluster.errors import ConfigError

EXPERIMENT = "experiment.yaml"
SERVER_APP = "fedcluster.flower.server:server_app"
CLIENT_APP = "fedcluster.flower.client:client_app"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _project_name(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "experiment"
    return f"fedcluster-{slug}"


def app_pyproject(
    name: str,
    out: str,
    config: str = EXPERIMENT,
    round_timeout: float = 0.0,
    min_replies: float = 0.0,
) -> str:
    """The ``pyproject.toml`` of a Flower App running fedcluster's apps."""
    from fedcluster import __version__

    settings = {
        "config": config,
        "preset": "",
        "out": out,
        "round-timeout": float(round_timeout),
        "min-replies": float(min_replies),
    }
    lines = [
        "# A Flower App (Flower 1.42): `flwr run . <superlink-connection>`; see fedcluster's",
        "# docs/flower.md. Written by `fedcluster flower app`.",
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        f"name = {_toml(_project_name(name))}",
        'version = "1.0.0"',
        f"description = {_toml(f'fedcluster experiment {name!r} on Flower nodes')}",
        'license = "Apache-2.0"',
        f'dependencies = ["fedcluster[flower]=={__version__}"]',
        "",
        "[tool.hatch.build.targets.wheel]",
        'packages = ["."]',
        "",
        "[tool.flwr.app]",
        'publisher = "fedcluster"',
        "",
        "[tool.flwr.app.components]",
        f"serverapp = {_toml(SERVER_APP)}",
        f"clientapp = {_toml(CLIENT_APP)}",
        "",
        "[tool.flwr.app.config]",
        *(f"{k} = {_toml(v)}" for k, v in settings.items()),
        "",
    ]
    return "\n".join(lines)


def write_app(
    folder: str | Path,
    config: ExperimentConfig,
    out: str | None = None,
    round_timeout: float = 0.0,
    min_replies: float = 0.0,
) -> Path:
    """Write the Flower App folder ``folder``: ``pyproject.toml`` and ``experiment.yaml``
    (the fully resolved ``config``). ``out`` is the run directory the ServerApp writes."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXPERIMENT).write_text(dump_config(config))
    out = out or f"runs/{config.name}-flower"
    text = app_pyproject(config.name, out, EXPERIMENT, round_timeout, min_replies)
    (folder / "pyproject.toml").write_text(text)
    return folder


def _app_file(name: str) -> Path:
    """``name`` as a file of the installed app: Flower puts the app folder (the one
    with its ``pyproject.toml``) first on ``sys.path``; else relative to the cwd."""
    path = Path(name)
    if path.is_absolute():
        return path
    for entry in sys.path:
        if entry and (Path(entry) / "pyproject.toml").is_file() and (Path(entry) / path).is_file():
            return Path(entry) / path
    return path


def config_from_run(run_config: Mapping[str, Any]) -> tuple[ExperimentConfig, str]:
    """The experiment and the output directory a run config names."""
    name = str(run_config.get("config") or "")
    preset = str(run_config.get("preset") or "") or None
    path = _app_file(name) if name else None
    if path is not None and not path.is_file():
        raise ConfigError(f"run config 'config': {name} not found in the app folder")
    over: dict[str, Any] = {}
    if float(run_config.get("round-timeout") or 0) > 0:
        over["round_timeout"] = float(run_config["round-timeout"])
    if float(run_config.get("min-replies") or 0) > 0:
        over["min_replies"] = float(run_config["min-replies"])
    config = resolve_config(path, preset, overrides={"deployment": over} if over else None)
    return config, str(run_config.get("out") or f"runs/{config.name}-flower")
