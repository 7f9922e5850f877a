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
- ``out``: the run directory, on the SuperLink's machine (an absolute path:
  a relative one would depend on the SuperLink's working directory);
- ``manifest``: the server's copy of the export's ``manifest.json`` (relative
  to the app folder, or absolute; empty: none), against which each node's
  reported file hashes are checked;
- ``round-timeout``, ``timeout-floor``, ``timeout-factor``, ``timeout-ceiling``,
  ``min-replies``:
  the experiment's ``deployment`` settings (``round-timeout = "auto"``: the
  measured timeout), written out explicitly; a value given here wins over the
  YAML's.

:func:`config_from_run` turns a run config into the experiment the
ServerApp runs (:func:`fedcluster.flower.server._deployed`).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedcluster.config.schema import DeploymentConfig, ExperimentConfig, dump_config, resolve_config
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.flower.nodedata import NodeManifest, read_manifest

EXPERIMENT = "experiment.yaml"
STATUS = "status.json"
"""The run directory's final status, written last by the deployed ServerApp
(:func:`fedcluster.flower.server.write_status`): ``{"status": "completed" |
"failed", "reason": ..., "finished": ...}``."""
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


MANIFEST = "manifest.json"


def app_pyproject(
    name: str, out: str, deployment: DeploymentConfig, config: str = EXPERIMENT, manifest: str = ""
) -> str:
    """The ``pyproject.toml`` of a Flower App running fedcluster's apps."""
    from fedcluster import __version__

    settings = {
        "config": config,
        "preset": "",
        "out": out,
        "manifest": manifest,
        "round-timeout": "auto" if deployment.round_timeout is None else deployment.round_timeout,
        "timeout-floor": deployment.timeout_floor,
        "timeout-factor": deployment.timeout_factor,
        "timeout-ceiling": deployment.timeout_ceiling,
        "min-replies": deployment.min_replies,
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
    manifest: str | Path | None = None,
) -> Path:
    """Write the Flower App folder ``folder``: ``pyproject.toml``, ``experiment.yaml``
    (the fully resolved ``config``) and, given the export's ``manifest``, its copy
    for the server (``manifest.json``). ``out`` is the run directory the ServerApp
    writes (made absolute here)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXPERIMENT).write_text(dump_config(config))
    out = str(Path(out or f"runs/{config.name}-flower").absolute())
    if manifest is not None:
        source = Path(manifest)
        if source.is_dir():
            source = source / MANIFEST
        read_manifest(source)  # a clear error for a file that is not a manifest
        shutil.copyfile(source, folder / MANIFEST)
    text = app_pyproject(
        config.name, out, config.deployment, EXPERIMENT, MANIFEST if manifest is not None else ""
    )
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


_DEPLOYMENT_KEYS = {
    "round-timeout": "round_timeout",
    "timeout-floor": "timeout_floor",
    "timeout-factor": "timeout_factor",
    "timeout-ceiling": "timeout_ceiling",
    "min-replies": "min_replies",
}


def config_from_run(
    run_config: Mapping[str, Any],
) -> tuple[ExperimentConfig, str, NodeManifest | None]:
    """The experiment, the output directory and the server's manifest a run config names."""
    name = str(run_config.get("config") or "")
    preset = str(run_config.get("preset") or "") or None
    path = _app_file(name) if name else None
    if path is not None and not path.is_file():
        raise ConfigError(f"run config 'config': {name} not found in the app folder")
    over: dict[str, Any] = {}
    for key, field in _DEPLOYMENT_KEYS.items():
        value = run_config.get(key)
        if value is None or value == "":
            continue
        if key == "round-timeout" and value == "auto":
            over[field] = None
            continue
        try:
            over[field] = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"run config '{key}': {value!r} is not a number") from None
    config = resolve_config(path, preset, overrides={"deployment": over} if over else None)
    manifest = str(run_config.get("manifest") or "")
    expected = None
    if manifest:
        file = _app_file(manifest)
        if not file.is_file():
            raise ConfigError(f"run config 'manifest': {manifest} not found in the app folder")
        expected = read_manifest(file)
    return config, str(run_config.get("out") or f"runs/{config.name}-flower"), expected


def read_status(run: Path) -> dict[str, str]:
    """The final status a deployed run's ServerApp wrote; a one-line error when there is none."""
    path = run / STATUS
    if not path.is_file():
        raise FedclusterError(
            f"{run}: no final status ({path.name}): the ServerApp is still running or "
            "ended without writing it; see flwr-run.log (fedcluster flower local: "
            f"{run / 'deployment' / 'flwr-run.log'}) or `flwr ls`"
        )
    try:
        status = json.loads(path.read_text())
        return {"status": str(status["status"]), "reason": str(status.get("reason", ""))}
    except (ValueError, KeyError, TypeError) as exc:
        raise FedclusterError(f"{path}: not a run status ({exc})") from None
