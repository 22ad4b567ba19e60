"""Plug-ins: code of the user's own that registers update rules, block schedules or aggregators.

A plug-in is one importable module. Importing it runs its decorators
(:func:`fedcybgd.rules.register_rule`, :func:`fedcybgd.strategies.register_schedule`,
:func:`fedcybgd.strategies.register_aggregator`), which add its pieces to the registries by
name; the run config then selects them by that name (``update-rule``, ``block-schedule``,
``aggregate``). The run-config key ``plugin-modules`` names the
modules: :class:`fedcybgd.config.RunConfig` imports them (:func:`load_modules`) on
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

:class:`Registry` is the one name table of every extension point: update rules (their specs),
tasks, block schedules and aggregators; :func:`resolve` the one place a ``"module:attr"`` text
is imported. Import-light: nothing here imports torch, Flower or either side of the app.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from fedcybgd.core.fields import ConfigError, unknown_key

__all__ = ["MODULE_PATTERN", "NAME_PATTERN", "Registry", "load_modules", "resolve"]

# Names travel in instructions, checkpoints and metrics: short, lower case, no spaces.
NAME_PATTERN = r"[a-z][a-z0-9_-]{0,31}"
MODULE_PATTERN = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
PLUGIN_KEY = "plugin-modules"

V = TypeVar("V")
TARGET_PATTERN = rf"{MODULE_PATTERN}:[A-Za-z_][\w.]*"  # "module:attr": a lazy entry


def resolve(target: str) -> Any:
    """The object ``"module:attr"`` names (``attr`` may be dotted), importing its module: the
    one place a name given as text is imported.

    Raises
    ------
    ValueError
        ``target`` is not ``"module:attr"``.
    ImportError, AttributeError
        The module cannot be imported, or has no such attribute.
    """
    if not isinstance(target, str) or not re.fullmatch(TARGET_PATTERN, target):
        raise ValueError(f"{target!r} is not 'module:attr'")
    module, _, attr = target.partition(":")
    found: Any = importlib.import_module(module)
    for part in attr.split("."):
        found = getattr(found, part)
    return found


class Registry(Generic[V]):
    """Entries by name, for one kind of extension (update rules, tasks, block schedules,
    aggregators): each an object, or a ``"module:attr"`` text imported on first use
    (:meth:`add_lazy`: an entry whose module is heavy or belongs to one side only is
    imported where it is used; the module may also register itself when imported).

    Parameters
    ----------
    what : str
        The kind, in words (``"block schedule"``), for messages.
    key : str
        The run-config key that selects one (``"block-schedule"``), for messages.
    check : callable, optional
        Raises ``ValueError`` on an entry that is not of the kind (default: it must be
        callable).
    """

    def __init__(self, what: str, key: str, check: Callable[[str, Any], None] | None = None
                 ) -> None:
        self.what, self.key = what, key
        self._check = check or self._callable
        self._entries: dict[str, V | str] = {}

    def _callable(self, name: str, entry: Any) -> None:
        if not callable(entry):
            raise ValueError(f"{self.what} {name!r}: the factory must be callable")

    def _name(self, name: str) -> None:
        if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
            raise ValueError(f"{self.what} name {name!r} must match {NAME_PATTERN}")

    def add(self, name: str, entry: V, *, replace: bool = False) -> V:
        """Make ``entry`` the one called ``name``; returns it.

        Raises
        ------
        ValueError
            ``name`` does not match :data:`NAME_PATTERN`, the entry is not of the kind, or
            ``name`` is taken and ``replace`` is false (a plug-in must not shadow a built-in by
            accident).
        """
        self._name(name)
        self._check(name, entry)
        taken = self._entries.get(name)
        # (a lazy entry's own module may register the object it names when imported)
        if taken is not None and taken is not entry and not replace and \
                not isinstance(taken, str):
            raise ValueError(f"a {self.what} named {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def add_lazy(self, name: str, target: str) -> None:
        """Make ``"module:attr"`` the entry called ``name``, imported on first use."""
        self._name(name)
        if not isinstance(target, str) or not re.fullmatch(TARGET_PATTERN, target):
            raise ValueError(f"{self.what} {name!r}: {target!r} is not 'module:attr'")
        if name in self._entries:
            raise ValueError(f"a {self.what} named {name!r} is already registered")
        self._entries[name] = target

    def register(self, name: str, *, replace: bool = False) -> Callable[[V], V]:
        """Decorator: make the decorated object the one called ``name`` (see :meth:`add`)."""
        self._name(name)

        def add(entry: V) -> V:
            return self.add(name, entry, replace=replace)

        return add

    def unregister(self, name: str) -> V | str:
        """Remove ``name`` (tests, interactive sessions); returns its entry (a lazy one's
        ``"module:attr"`` text, not imported).

        Raises
        ------
        KeyError
            Nothing of that name is registered.
        """
        return self._entries.pop(name)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (the built-ins first)."""
        return tuple(self._entries)

    def find(self, name: str) -> V | None:
        """The entry called ``name`` (a lazy one imported now), or ``None``."""
        entry = self._entries.get(name)
        if isinstance(entry, str):
            found: V = resolve(entry)
            current = self._entries.get(name)
            if current is not None and not isinstance(current, str):
                return current  # the import registered it itself
            self._check(name, found)
            self._entries[name] = entry = found
        return entry

    def get(self, name: str) -> V:
        """The entry called ``name``.

        Raises
        ------
        ConfigError
            Nothing of that name is registered; the message names the key, suggests the
            closest registered name and says how a plug-in is loaded.
        """
        entry = self.find(name)
        if entry is None:
            err = unknown_key(name, self._entries, what=self.what)
            raise ConfigError(f"{self.key} = {name!r}: {err} (one of your own: name its module "
                              f"in {PLUGIN_KEY})")
        return entry


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
