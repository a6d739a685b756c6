"""What a run keeps on disk: its directory (run) and its checkpoints (checkpoint)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from etrain.core.config.base import Section


class CheckpointConfig(Section):
    every: int = Field(
        50,
        ge=0,
        description="steps between full checkpoints (weights, optimizer, scheduler, scaler); 0 = only at the end",
    )
    light_every: int = Field(
        0,
        ge=0,
        description="steps between light checkpoints (changed weights only, in light_dtype; "
        "a resume from one takes the optimizer state of the last full one, so it is not exact); 0 = none",
    )
    light_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of a light checkpoint's weights"
    )
    async_save: bool = Field(
        True, description="write checkpoints in the background: a step waits only while the state is copied"
    )
    uri: str | None = Field(None, description="directory or URI; default RUN_DIR/checkpoints")
    keep: int = Field(3, ge=1, description="full checkpoints kept (and as many light ones after the newest)")
    every_s: float = Field(
        0,
        ge=0,
        description="also a full checkpoint once this many seconds have passed since the last one began (a wall-clock "
        "cadence beside `every`, for steps of uneven length); 0 = none",
    )


class RunConfig(Section):
    root: str = Field("runs", description="parent directory of run directories")
    name: str | None = Field(
        None, description="run directory name, one name inside run.root (any language); default a timestamp"
    )

    @field_validator("name")
    @classmethod
    def _one_name(cls, name: str | None) -> str | None:
        """The run's directory inside run.root, never outside it (../x) or the root itself (.)."""
        if name is None:
            return name
        if name in ("", ".", "..") or any(c in name for c in "/\\") or not name.isprintable():
            raise ValueError(
                "must be one directory name inside run.root (no / or \\, not . or .., no control characters)"
            )
        if len(name.encode()) > 255:
            raise ValueError(f"is {len(name.encode())} bytes long; a directory name takes at most 255")
        return name
