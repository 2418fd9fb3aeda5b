"""One config value checked against its dataclass annotation, with one-line errors (``ConfigError``).

The floor of the config modules: ``config.py`` and ``layered_config.py`` use it, and it imports nothing of stemlm.

Config values arrive from YAML files and ``section.field=value`` overrides, so a number may come
as a string, an integer as ``1e3`` and a list where a tuple is declared. ``coerce(value, hint,
name)`` turns such a value into the annotated type or raises ``ConfigError`` naming the field, the
value and what is allowed:

* ``int``: an integer (a float with an integral value such as ``1e3`` is accepted as one);
* ``float``: a finite number (``inf`` and ``nan`` are refused; a numeric string is parsed);
* ``bool``: ``true`` or ``false`` only;
* ``str``: a string (a plain number is taken as its text);
* ``X | None``: None or an ``X``; ``X | Y``: the first that fits;
* ``tuple[X, ...]`` / ``list[X]``: a list or tuple whose items are ``X``;
* ``Any``: anything.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the problem."""


def coerce(value: Any, hint: Any, name: str) -> Any:
    """``value`` as the type ``hint`` describes, or a ``ConfigError`` naming ``name``."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(value, option, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: {value!r} is not {describe(hint)}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: {value!r} is not {describe(hint)}")
        item = args[0] if args else Any
        items = [coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    check = _SCALARS.get(hint)
    if check is None:  # a type this module does not know: leave the value to the class
        return value
    out = check(value)
    if out is _BAD:
        raise ConfigError(f"{name}: {value!r} is not {describe(hint)}")
    return out


def coerce_fields(obj, prefix: str = "") -> None:
    """Check and convert every init field of the dataclass instance ``obj`` in place (frozen too)."""
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        if f.init and f.name in hints:
            value = coerce(getattr(obj, f.name), hints[f.name], f"{prefix}{f.name}")
            object.__setattr__(obj, f.name, value)


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, Any]:
    """The resolved annotations of a dataclass (cached: string annotations are evaluated once)."""
    return typing.get_type_hints(cls)


def describe(hint: Any) -> str:
    """What a value of type ``hint`` must be, in words (for error messages)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin in (tuple, list):
        return f"a list of {_PLURAL.get(args[0], 'values') if args else 'values'}"
    return _WORDS.get(hint, getattr(hint, "__name__", str(hint)))


_BAD = object()


def _int(v):
    if isinstance(v, bool):
        return _BAD
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    return _BAD


def _float(v):
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return _BAD
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return _BAD
    return float(v)


def _bool(v):
    return v if isinstance(v, bool) else _BAD


def _str(v):
    if isinstance(v, str):
        return v
    return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _BAD


_SCALARS = {int: _int, float: _float, bool: _bool, str: _str}
_WORDS = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}
_PLURAL = {int: "integers", float: "finite numbers", bool: "booleans", str: "strings"}
