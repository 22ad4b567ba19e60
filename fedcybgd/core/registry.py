"""Plug-ins: code of the user's own that registers update rules, block schedules or aggregators.

A plug-in is one importable module. Importing it runs its decorators
(:func:`fedcybgd.rules.register_rule`, :func:`fedcybgd.strategies.register_schedule`,
:func:`fedcybgd.strategies.register_aggregator`), which add its pieces to the registries by
name; the run config then selects them by that name (``update-rule``, ``block-schedule``,
``aggregate``). The run-config key ``plugin-modules`` (and its older name ``rule-modules``)
names the modules: :class:`fedcybgd.config.RunConfig` imports them (:func:`load_modules`) on
the server at start and on every client, from the same run config, so both sides see the same
registries.

**Why a decorator and a run-config key, not an entry-point group:**

* ``flwr run`` ships the app as a FAB, unpacked but not pip-installed when Flower's runtime
  dependency installation is off (as this project runs it), so an entry point declared by the
  user's app would never be seen; a one-file plug-in in the app folder is on ``sys.path`` and
  is found by importing it.
* A config key is explicit and travels with the run: the server, every SuperNode, the
  checkpoint and ``summary.json`` all record which plug-ins a run used. An installed package's
  entry point would silently add names (and option keys every run then validates) to every run
  on that machine.
* It works alike in simulation, deployment, the loopback grid and tests. A pip-installed
  plug-in package is used the same way: name its module in ``plugin-modules``.

:class:`Registry` is the name table behind schedules and aggregators (update rules keep their
own, :mod:`fedcybgd.rules.registry`, as a rule declares more than a factory). Import-light:
nothing here imports torch, Flower or either side of the app.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from fedcybgd.core.fields import ConfigError, unknown_key

__all__ = ["MODULE_PATTERN", "NAME_PATTERN", "Registry", "load_modules"]

# Names travel in instructions, checkpoints and metrics: short, lower case, no spaces.
NAME_PATTERN = r"[a-z][a-z0-9_-]{0,31}"
MODULE_PATTERN = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
PLUGIN_KEY = "plugin-modules"

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """Factories by name, for one kind of plug-in (block schedules, aggregators).

    Parameters
    ----------
    what : str
        The kind, in words (``"block schedule"``), for messages.
    key : str
        The run-config key that selects one (``"block-schedule"``), for messages.
    """

    def __init__(self, what: str, key: str) -> None:
        self.what, self.key = what, key
        self._factories: dict[str, F] = {}

    def register(self, name: str, *, replace: bool = False) -> Callable[[F], F]:
        """Decorator: make the decorated factory the one called ``name``.

        Raises
        ------
        ValueError
            ``name`` does not match :data:`NAME_PATTERN`, or is taken and ``replace`` is false
            (a plug-in must not shadow a built-in by accident).
        """
        if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
            raise ValueError(f"{self.what} name {name!r} must match {NAME_PATTERN}")

        def add(factory: F) -> F:
            if not callable(factory):
                raise ValueError(f"{self.what} {name!r}: the factory must be callable")
            taken = self._factories.get(name)
            if taken is not None and taken is not factory and not replace:
                raise ValueError(f"a {self.what} named {name!r} is already registered")
            self._factories[name] = factory
            return factory

        return add

    def unregister(self, name: str) -> F:
        """Remove ``name`` (tests, interactive sessions); returns its factory.

        Raises
        ------
        KeyError
            Nothing of that name is registered.
        """
        return self._factories.pop(name)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (the built-ins first)."""
        return tuple(self._factories)

    def get(self, name: str) -> F:
        """The factory called ``name``.

        Raises
        ------
        ConfigError
            Nothing of that name is registered; the message names the key, suggests the
            closest registered name and says how a plug-in is loaded.
        """
        factory = self._factories.get(name)
        if factory is None:
            err = unknown_key(name, self._factories, what=self.what)
            raise ConfigError(f"{self.key} = {name!r}: {err} (one of your own: name its module "
                              f"in {PLUGIN_KEY})")
        return factory


def load_modules(modules: str | Iterable[str], key: str = PLUGIN_KEY) -> list[str]:
    """Import the plug-in modules named in ``modules`` (comma-separated text or names).

    Importing a module runs its registration decorators; a module already imported is not
    imported again. Returns the names imported.

    Raises
    ------
    ConfigError
        A name is not a dotted module name, or importing it fails (the cause is chained and
        named in the message, with ``key``).
    """
    names = modules.split(",") if isinstance(modules, str) else list(modules)
    loaded: list[str] = []
    for raw in names:
        module = raw.strip()
        if not module:
            continue
        if not re.fullmatch(MODULE_PATTERN, module):
            raise ConfigError(f"{key}: {module[:80]!r} is not a module name (dotted identifiers, "
                              "comma-separated)")
        try:
            importlib.import_module(module)
        except Exception as err:
            # Anything a plug-in raises while importing stops the run at start, named.
            raise ConfigError(f"{key}: importing {module!r} failed: "
                              f"{type(err).__name__}: {err}") from err
        loaded.append(module)
    return loaded
