"""``fedcybgd run``'s check before Flower starts anything: the app's run config with the
command's overrides, read as the ServerApp will read it, and its model.

A value of the wrong type or out of range, or a model no one could load, would otherwise be
found by the ServerApp after the SuperLink, the simulation and Ray have started, under a page
of traceback; here it is one line (:func:`launch_refusal`), and ``fedcybgd run`` exits 2.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.deploy.diagnose import LOCAL_ADDRESSES, flower_home, superlink_address
from fedcybgd.model import loading

SERVER_APP = "fedcybgd.server.app:app"  # the ServerApp whose run config these checks know
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def launch_refusal(app: str, run_config: list[str], superlink: str | None,
                   env: Mapping[str, str]) -> str | None:
    """Why ``flwr run APP [SUPERLINK] --run-config ...`` would fail at start, before Flower
    starts anything (no SuperLink, no simulation, no Ray); ``None`` when nothing is found.

    Only apps whose ServerApp is :data:`SERVER_APP` are checked. The app's run config
    (``[tool.flwr.app.config]``) with the overrides applied in order, as Flower applies them, is
    read as the ServerApp will (:meth:`RunConfig.from_run_config`: every key's type, range and
    choices, plug-in modules imported from the app's folder), then the ``model``: on the
    managed local SuperLink or one on this machine, as the ServerApp will
    (:func:`fedcybgd.model.loading.check_model`, the hub as ``env`` allows); on another
    machine's, only the name's form. Override syntax and keys the app does not have are left to
    ``flwr run``, whose refusal names them.

    Parameters
    ----------
    app : str
        The Flower App's folder.
    run_config : list of str
        The ``--run-config`` values (``k=v`` strings, or one TOML file).
    superlink : str, optional
        The SuperLink connection (``None``: the Flower configuration's default).
    env : Mapping[str, str]
        The environment ``flwr`` runs in (``FLWR_HOME``, ``HF_HUB_OFFLINE``).

    Returns
    -------
    str or None
        One line, ``run config: ...``, naming the key and what is wrong.
    """
    import click
    from flwr.common.config import flatten_dict, parse_config_args

    folder = Path(app).expanduser()
    project = folder / "pyproject.toml"
    if not project.is_file():
        return None  # not an app folder here (a .fab file, or an app the SuperLink has)
    with project.open("rb") as f:
        flwr = tomllib.load(f).get("tool", {}).get("flwr", {}).get("app", {})
    if flwr.get("components", {}).get("serverapp") != SERVER_APP:
        return None
    defaults = flatten_dict(flwr.get("config", {}))
    try:
        overrides = parse_config_args(run_config or None)
    except (click.ClickException, ValueError, OSError):
        return None  # flwr run reads the same text and names what is wrong with it
    if any(key not in defaults for key in overrides):
        return None  # flwr run refuses them, and the launcher names the closest key
    sys.path.insert(0, str(folder.resolve()))  # plug-in modules, as in the app's bundle
    try:
        run = RunConfig.from_run_config({**defaults, **overrides})
        loading.check_model(run.model, here=_on_this_machine(superlink, env),
                            offline=loading.hub_offline(dict(env)))
    except ConfigError as err:
        return f"run config: {err}"
    finally:
        sys.path.remove(str(folder.resolve()))
    return None


def _on_this_machine(superlink: str | None, env: Mapping[str, str]) -> bool:
    """Whether SuperLink connection ``superlink`` runs its ServerApps on this machine: the
    managed local SuperLink (also when Flower has no configuration yet: it makes that one the
    default) or an address on the loopback interface."""
    address = superlink_address(flower_home(env), superlink)
    if address is None:
        return superlink in (None, "local")
    if address in LOCAL_ADDRESSES:
        return True
    host = urlsplit(f"//{address}").hostname
    return host in _LOOPBACK
