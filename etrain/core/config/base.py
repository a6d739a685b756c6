"""What every config section shares: no unknown keys, no changes after validation, no inf or NaN, no boolean
for a number; and ConfigError, the error a wrong config raises."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from etrain.core.errors import UsageError


class ConfigError(UsageError):
    """A config the user gave is wrong; the message says what and how to fix it."""


class Section(BaseModel):
    # No inf or NaN anywhere (optim.lr=.inf would fail only at step 2).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's `true` would pass as 1 (train.steps=true trains one step); a number key takes a number."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and annotation in (int, float, int | None, float | None):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value
