"""`etrain finetune`: a new run from a trained model's weights, LoRA adapters on them (the default) or all of them
trained."""

from __future__ import annotations

from etrain.cli.jobs import from_base
from etrain.cli.options import add_base, add_config, add_progress, command


def add_command(sub) -> None:
    p = command(
        sub,
        "finetune",
        cmd_finetune,
        "fine-tune a trained model: LoRA adapters on it (the default) or all its weights; resume with etrain train",
        "etrain finetune --from runs/base --set data.source=corpus/ --set train.steps=200",
        "etrain finetune --from runs/base/checkpoints/step-00000500 --config ft.yaml --set finetune.lora.rank=4",
        "etrain finetune --from runs/base --set finetune.method=full --set optim.lr=3e-4",
        "etrain finetune --from models/llama-hf --adapter adapters/llama-lora --set data.source=corpus/",
        "etrain finetune --from models/llama-hf --data chat.jsonl --set train.steps=300",
    )
    add_config(p)
    add_base(p, "the model to fine-tune")
    p.add_argument(
        "--adapter",
        metavar="PEFT_DIR",
        help="continue these LoRA adapters (a PEFT directory: adapter_config.json, adapter_model.safetensors; "
        "etrain export --format peft writes one); the run takes their rank, alpha and targets",
    )
    p.add_argument(
        "--data",
        metavar="CHAT.jsonl",
        help="instruction-tune on chat records ({messages: [{role, content}...]} or {prompt, completion} per line), "
        "rendered with the base's chat template, the loss on the assistant's answers alone; prepared once under "
        "run.root/chat-data/",
    )
    add_progress(p)


def cmd_finetune(args, started_at: float) -> int:
    return from_base(args, args.source, args.set, started_at, adapter=args.adapter, chat=args.data)
