"""The search space: a YAML file of config keys and their distributions, checked before any trial runs.

    optim.lr:           {loguniform: [1.0e-4, 1.0e-2]}
    optim.weight_decay: {uniform: [0.0, 0.2]}
    model.n_layer:      {int: [1, 4]}
    optim.warmup_steps: {choice: [10, 20, 40]}

Every key must be a config key, and the config must accept every bound and choice
(applied one at a time to the base config), so a typo or an impossible value fails
here, naming the parameter, rather than as a failed trial an hour in.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna.distributions as dist
import yaml

from etrain.core.config import Config, ConfigError, override

KINDS = ("loguniform", "uniform", "int", "choice")
FIXED = {"train.steps": "it is each trial's budget (the early-stopping scheduler's time axis); set it in --config"}


def load_space(path: str | Path, base: Config) -> dict[str, dist.BaseDistribution]:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"search space {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"search space {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"search space {path}: give a mapping of config keys to distributions, e.g. optim.lr: "
            f"{{loguniform: [1.0e-4, 1.0e-2]}}"
        )
    return {str(key): parameter(str(key), spec, base) for key, spec in raw.items()}


def parameter(key: str, spec: Any, base: Config) -> dist.BaseDistribution:
    """One parameter's distribution; a ConfigError naming `key` if it is malformed or the config refuses it."""
    if key in FIXED:
        raise ConfigError(f"search space parameter {key!r} cannot be searched: {FIXED[key]}")
    if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in KINDS):
        raise ConfigError(
            f"search space parameter {key!r}: give exactly one of {', '.join(KINDS)} (e.g. {{uniform: [0.0, 0.2]}}), "
            f"got {spec!r}"
        )
    kind, args = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"search space parameter {key!r}: choice needs a non-empty list of values, got {args!r}")
        out = dist.CategoricalDistribution(args)
        values = args
    else:
        if not (isinstance(args, list) and len(args) == 2 and all(_number(a) for a in args) and args[0] < args[1]):
            raise ConfigError(f"search space parameter {key!r}: {kind} needs [low, high] with low < high, got {args!r}")
        low, high = args
        if kind == "loguniform" and low <= 0:
            raise ConfigError(f"search space parameter {key!r}: loguniform needs low > 0, got {low}")
        if kind == "int":
            if not all(float(a).is_integer() for a in args):
                raise ConfigError(f"search space parameter {key!r}: int needs whole-number bounds, got {args!r}")
            out = dist.IntDistribution(int(low), int(high))
        else:
            out = dist.FloatDistribution(float(low), float(high), log=kind == "loguniform")
        values = [out.low, out.high]
    for value in values:
        try:
            override(base, {key: value})
        except ConfigError as e:
            raise ConfigError(f"search space parameter {key!r} = {value!r} is not a valid config: {e}") from None
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
