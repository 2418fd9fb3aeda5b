"""Nested dataclass configs: defaults, then a YAML file, then dotted overrides (``model.d_model=64``).

Values of overrides are parsed as YAML scalars (``3`` -> int, ``1e-3`` -> float, ``[2,5]`` -> list,
``true`` -> bool); anything else stays a string.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigError


def parse_value(text: str) -> Any:
    """Parse an override value as a YAML scalar or flow list."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and _looks_float(text):
        return float(text)
    return text if value is None and text not in ("null", "~", "None") else value


def _looks_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_overrides(items: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``; a malformed item is a clear error."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, value = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override")
        node[parts[-1]] = parse_value(value.strip())
    return out


def deep_merge(base: dict, update: dict) -> dict:
    """Recursively merge ``update`` into a copy of ``base``."""
    out = dict(base)
    for k, v in update.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str | Path) -> dict:
    """A YAML mapping from ``path`` (clear error if missing or not a mapping)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    return data


def dataclass_to_dict(obj) -> dict:
    """Init fields of a (nested) dataclass as plain dicts (derived fields left out)."""
    out = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = dataclass_to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def build_dataclass(cls, data: dict, where: str = ""):
    """Instantiate a (nested) dataclass from a dict; unknown keys raise a clear error."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"unknown config field {where}{key!r}; valid: {', '.join(sorted(fields))}")
        sub = _dataclass_type(cls, key)
        kwargs[key] = build_dataclass(sub, value, f"{where}{key}.") if sub and isinstance(value, dict) else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad config for {where or cls.__name__}: {e}") from None


def _dataclass_type(cls, name: str):
    t = typing.get_type_hints(cls).get(name)
    return t if dataclasses.is_dataclass(t) else None


def resolve_config(cls, defaults: dict | None = None, yaml_file: str | None = None, overrides: list[str] | None = None):
    """defaults -> YAML -> dotted overrides -> ``cls`` instance."""
    data = dict(defaults or {})
    if yaml_file:
        data = deep_merge(data, load_yaml(yaml_file))
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
    return build_dataclass(cls, data)
