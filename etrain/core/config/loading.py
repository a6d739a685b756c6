"""From what the user names to a validated Config: a preset of etrain/configs/ or a YAML file, `--set a.b=value`
overrides, unknown keys caught with a did-you-mean, and pydantic's errors as one line per key."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from etrain.core.config.base import ConfigError
from etrain.core.config.root import Config

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs"  # package data: a wheel ships them


def load_config(config: str | dict | None = None, overrides: list[str] = ()) -> Config:
    """Preset name, YAML file or a config's raw dict, then `a.b=value` overrides, then validation."""
    raw = raw_config(config)
    for item in overrides:
        key, value = _parse_override(item)
        _set_path(raw, key, value)
    return validate(raw)


def raw_config(config: str | dict | None) -> dict:
    """A preset's, a YAML file's or a raw dict's keys as given (a copy), before defaults and validation."""
    return copy.deepcopy(config) if isinstance(config, dict) else _read_yaml(resolve_preset(config)) if config else {}


def override(cfg: Config, values: dict[str, Any]) -> Config:
    """`cfg` with dotted keys set (a trial's parameters), validated again."""
    raw = cfg.model_dump()
    for key, value in values.items():
        _set_path(raw, key, value)
    return validate(raw)


def resolve_preset(config: str) -> Path:
    path = Path(config)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {config!r} does not exist")
        return path
    preset = PRESET_DIR / f"{config}.yaml"
    if preset.is_file():
        return preset
    names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    raise ConfigError(
        f"no config file or preset named {config!r}{_did_you_mean(config, names)}; presets: {', '.join(names)}"
    )


def validate(raw: dict[str, Any]) -> Config:
    _check_keys(raw, Config, "")
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, train:, ...)")
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _set_path(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parents[: i + 1])} is a value, not a section")
        node = child
    node[leaf] = value


def _check_keys(raw: Any, model: type[BaseModel], prefix: str) -> None:
    """Unknown keys anywhere in the tree, with a did-you-mean."""
    if not isinstance(raw, dict):
        return
    fields = model.model_fields
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if key not in fields:
            known = list(fields)
            raise ConfigError(
                f"unknown config key {where!r}{_did_you_mean(str(key), known, prefix)}; allowed here: "
                f"{', '.join(known)}"
            )
        sub = fields[key].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {where!r} is a section; give its keys ({', '.join(sub.model_fields)})")
            _check_keys(value, sub, f"{where}.")


def _format_errors(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], (dict, list)) else ""
        lines.append(f"config key {key!r}: {message}{got}" if key else f"config: {message}")
    return "\n".join(lines)


def _did_you_mean(word: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""
