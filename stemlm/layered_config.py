"""How any config is read (as Meta Lingua's ``args.py``): a nested dataclass filled in layers, defaults,
then a YAML file, then dotted overrides (``model.d_model=64``).

Values of overrides are parsed as YAML scalars (``3`` -> int, ``1e-3`` -> float, ``[2,5]`` -> list,
``true`` -> bool); anything else stays a string. Each value is then checked against its field's
annotation by ``fields.py``. The configs themselves live where they are used (``config.ModelConfig``,
``train.config.TrainConfig``); command-line flags (argparse) are ``stemlm/cli/options.py``'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from .fields import ConfigError, coerce, field_types


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
    """A YAML mapping from ``path`` (clear error if missing, unreadable or not a mapping)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" if not path.exists() else f"config file {path} is not a file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    return yaml_mapping(text, f"config file {path}")


def yaml_mapping(text: str, source: str) -> dict:
    """The YAML mapping in ``text``; a YAML syntax error or another top-level kind is one clear error."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"{source} is not valid YAML{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a mapping (section: {{field: value}}) at top level, "
                          f"got {type(data).__name__}")
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
    """Instantiate a (nested) dataclass from a dict.

    Unknown keys are a clear error, and every value is checked against its field's annotation
    (``stemlm.fields.coerce``: integers, finite floats, booleans ...) before the class's own
    range checks run in ``__post_init__``.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.') or cls.__name__} must be a mapping of fields, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"unknown config field {where}{key!r}; valid: {', '.join(sorted(fields))}")
        hint = hints.get(key)
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_dataclass(hint, value, f"{where}{key}.")
        else:
            kwargs[key] = coerce(value, hint, f"{where}{key}") if key in hints else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad config for {where or cls.__name__}: {e}") from None


def resolve_config(cls, defaults: dict | None = None, yaml_file: str | None = None, overrides: list[str] | None = None):
    """defaults -> YAML -> dotted overrides -> ``cls`` instance."""
    data = dict(defaults or {})
    if yaml_file:
        data = deep_merge(data, load_yaml(yaml_file))
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
    return build_dataclass(cls, data)
