"""`etrain export`: a run's trained weights written as a plain model (a run directory or a Hugging Face one), or a
LoRA run's adapters as a PEFT adapter directory."""

from __future__ import annotations

import json
from pathlib import Path

from etrain.cli.options import command


def add_command(sub) -> None:
    p = command(
        sub,
        "export",
        cmd_export,
        "write a run's trained weights as a plain model (a LoRA run's adapters merged into its base) or its adapters",
        "etrain export runs/lora --merge --out models/lora-merged",
        "etrain export runs/llama --format hf --out models/llama-hf",
        "etrain export runs/llama-lora --format peft --out adapters/llama-lora",
    )
    p.add_argument("run", metavar="RUN_DIR", help="the run whose latest committed checkpoint is exported")
    p.add_argument("--out", required=True, help="a new or empty directory: config.yaml and checkpoints/")
    p.add_argument("--merge", action="store_true", help="fold a LoRA run's adapters into its base's weights")
    p.add_argument(
        "--format",
        choices=("run", "hf", "peft"),
        default="run",
        help="run: config.yaml and checkpoints/ (etrain finetune --from takes it); hf: a Hugging Face directory "
        "(config.json, sharded safetensors and their index) of a model.family=llama run; peft: a LoRA run's "
        "adapters alone, as PEFT's adapter directory (adapter_config.json, adapter_model.safetensors) for its base",
    )


def cmd_export(args, started_at: float) -> int:
    from etrain.driver.export import export

    # --out as given, not resolved: a link in it is export's to judge (a dangling one is refused)
    run, out = Path(args.run).expanduser().resolve(), Path(args.out).expanduser().absolute()
    written = export(run, out, args.merge, args.format)
    print(json.dumps(written, indent=1))
    return 0
