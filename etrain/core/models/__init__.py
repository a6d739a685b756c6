"""The model families, one folder each (docs/models.md, "Adding a family"): the folder's __init__ defines its spec,
`FAMILY` (etrain/core/models/family.py says what a family provides), and its model.py the torch module; what every
family shares is in shared.py. Found here by listing the folders: a new family is a new folder. Nothing outside this
package names a family's parts or tests its name (tests/test_layers.py)."""

from __future__ import annotations

import pkgutil
from importlib import import_module
from typing import TYPE_CHECKING

from etrain.core.models.family import Family, HFFormat

if TYPE_CHECKING:
    from etrain.core.config import ModelConfig
    from etrain.core.models.shared import LanguageModel

FAMILIES: dict[str, Family] = {
    spec.name: spec
    for spec in (
        import_module(f"{__name__}.{found.name}").FAMILY for found in pkgutil.iter_modules(__path__) if found.ispkg
    )
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family={name} is not a family here; the families: {', '.join(FAMILIES)}") from None


def by_architecture(architecture: str) -> Family | None:
    """The family reading a Hugging Face config.json of this `architectures` entry."""
    return next((f for f in FAMILIES.values() if f.hf and architecture in f.hf.architectures), None)


def make_model(cfg: ModelConfig) -> LanguageModel:
    """The model of `cfg`'s family, its weights initial_weight's (none on the meta device)."""
    return family(cfg.family).build(cfg)


__all__ = ["FAMILIES", "Family", "HFFormat", "by_architecture", "family", "make_model"]
