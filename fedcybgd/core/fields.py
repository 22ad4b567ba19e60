"""Typed, range-checked config fields: how a flat ``key -> value`` map becomes a dataclass.

The run config, the node config and each update rule's options are frozen dataclasses whose
fields are declared with :func:`setting`: the key (dashes, as Flower spells it), the default and
the range or the allowed values. :func:`build` turns a flat map into such a dataclass; every key
must be known (an unknown one is refused with the closest known key suggested), and
:func:`normalize`, called from each dataclass's ``__post_init__``, makes every value its declared
type, refuses NaN and infinities and checks the range, so a dataclass built in code is checked
as strictly as one built from ``flwr run``. Every message names the key.

No imports from the rest of the package: the server, the clients and the tools all use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, get_type_hints

_META = "fedcybgd.setting"
_DOC = "fedcybgd.setting.doc"


class ConfigError(ValueError):
    """A run-config or node-config value is unknown, missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class Bounds:
    """What a field accepts besides its type.

    Attributes
    ----------
    key : str or None
        The config key; ``None``: the field name with dashes for underscores.
    ge, gt, le, lt : float or None
        Inclusive and exclusive lower and upper bounds of a number.
    choices : tuple of str or None
        The allowed values of a string.
    """

    key: str | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None

    def describe(self) -> str:
        """The range in words, e.g. ``in (0, 1]`` or ``>= 1``; empty when unbounded."""
        if self.choices is not None:
            return f"one of {list(self.choices)}"
        low = f"[{_num(self.ge)}" if self.ge is not None else (
            f"({_num(self.gt)}" if self.gt is not None else None)
        high = f"{_num(self.le)}]" if self.le is not None else (
            f"{_num(self.lt)})" if self.lt is not None else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"{'>=' if self.ge is not None else '>'} {low[1:]}"
        if high:
            return f"{'<=' if self.le is not None else '<'} {high[:-1]}"
        return ""

    def check(self, key: str, value: Any) -> None:
        """Raise :class:`ConfigError` naming ``key`` when ``value`` is outside the bounds."""
        if self.choices is not None:
            if value not in self.choices:
                raise ConfigError(
                    f"{key} = {_show(value)} is not allowed; choose one of {list(self.choices)}"
                )
            return
        inside = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )
        if not inside:
            raise ConfigError(f"{key} must be {self.describe()}, got {_show(value)}")


def _show(value: Any) -> str:
    """``repr(value)``, cut short (a hostile value may be a 10,000-digit integer)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def setting(
    default: Any,
    *,
    key: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[str, ...] | None = None,
    doc: str = "",
    section: str | None = None,
) -> Any:
    """A dataclass field that is a config key.

    Parameters
    ----------
    default : bool, int, float or str
        The default; the field's annotation gives the type.
    key : str, optional
        The config key; default: the field name with dashes for underscores.
    ge, gt, le, lt : float, optional
        Bounds of a number (``>=``, ``>``, ``<=``, ``<``).
    choices : tuple of str, optional
        The allowed values of a string (keep the tuple in :mod:`fedcybgd.choices`).
    doc : str
        What the key means, for its user: the configuration reference is generated from it
        (``python -m fedcybgd.cli.reference``). Markdown; the range is added from the bounds.
    section : str, optional
        Starts a section of the reference here: this field and the ones declared after it,
        up to the next field that starts one.
    """
    bounds = Bounds(key=key, ge=ge, gt=gt, le=le, lt=lt, choices=choices)
    return dataclasses.field(default=default, metadata={_META: bounds, _DOC: (doc, section)})


@dataclass(frozen=True)
class Setting:
    """One config key of a dataclass: its field, type, default, bounds and documentation
    (``section``: the reference section it starts, if any)."""

    key: str
    name: str
    kind: type
    default: Any
    bounds: Bounds
    doc: str = ""
    section: str | None = None


def settings(cls: Any) -> dict[str, Setting]:
    """The config keys of the dataclass ``cls`` (fields declared with :func:`setting`)."""
    hints = get_type_hints(cls)
    out: dict[str, Setting] = {}
    for f in dataclasses.fields(cls):
        bounds = f.metadata.get(_META)
        if bounds is None:
            continue
        key = bounds.key or f.name.replace("_", "-")
        doc, section = f.metadata.get(_DOC, ("", None))
        out[key] = Setting(key, f.name, hints[f.name], f.default, bounds, doc, section)
    return out


def coerce(key: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind`` (bool, int, float or str), or :class:`ConfigError` naming ``key``.

    Integers are accepted for floats, and integral floats for integers; ``"true"``/``"false"``
    for booleans. NaN and infinities are refused; so are numbers given as strings.
    """
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key} must be true or false, got {_show(value)}")
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {_show(value)}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be an integer, got {_show(value)}")
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise ConfigError(f"{key} must be a finite integer, got {_show(value)}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {_show(value)}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{key} must be a finite number, got {_show(value)}")
        return number
    raise TypeError(f"{key}: config fields are bool, int, float or str, not {kind!r}")


def normalize(instance: Any) -> None:
    """Coerce and range-check every config field of a frozen dataclass, in place.

    Call from ``__post_init__``; cross-field rules stay with the dataclass.
    """
    for s in settings(type(instance)).values():
        value = coerce(s.key, getattr(instance, s.name), s.kind)
        s.bounds.check(s.key, value)
        object.__setattr__(instance, s.name, value)


def closest(key: str, known: Iterable[str]) -> str | None:
    """The known key most like ``key`` (a likely misspelling), or ``None``."""
    matches = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key(key: str, known: Iterable[str], what: str = "key") -> ConfigError:
    """The error for an unknown ``key``: names it and suggests the closest known key."""
    known = sorted(known)
    match = closest(key, known)
    hint = f"did you mean {match!r}?" if match else f"known {what}s: {', '.join(known)}"
    return ConfigError(f"unknown {what} {key!r}; {hint}")


def build(cls: Any, raw: Mapping[str, Any], *, also_known: Iterable[str] = (),
          **fixed: Any) -> Any:
    """The dataclass ``cls`` from the flat map ``raw``; every key of ``raw`` must be known.

    Parameters
    ----------
    cls : type
        A dataclass whose config fields are declared with :func:`setting`.
    raw : Mapping
        ``key -> value`` as Flower gives it (dashes).
    also_known : iterable of str
        Keys the caller takes out of ``raw`` itself; only used to suggest the closest key.
    **fixed
        Further constructor arguments (fields that are not config keys).

    Raises
    ------
    ConfigError
        A key is unknown, or a value of the wrong type or out of range.
    """
    fields = settings(cls)
    kwargs = dict(fixed)
    for key, value in raw.items():
        s = fields.get(key)
        if s is None:
            raise unknown_key(key, [*fields, *also_known])
        kwargs[s.name] = coerce(key, value, s.kind)
    return cls(**kwargs)
