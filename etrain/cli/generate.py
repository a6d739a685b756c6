"""`etrain generate`: a prompt continued by a trained model, on this machine (no Ray)."""

from __future__ import annotations

import math
import sys

from etrain.cli.options import command


def add_command(sub) -> None:
    p = command(
        sub,
        "generate",
        cmd_generate,
        "continue a prompt with a trained model: a run, a checkpoint or a Hugging Face directory (KV cache)",
        'etrain generate runs/tiny --prompt "def main():" --max-new-tokens 64',
        'etrain generate models/llama-hf --prompt "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 1',
        'etrain generate runs/sft --chat --prompt "What is two plus three?"',
    )
    p.add_argument("source", metavar="RUN_OR_DIR", help="a run directory, a checkpoint, or a Hugging Face directory")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's message, rendered with the model's chat template; prints the answer alone",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: the likeliest token each time (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="draw within the tokens holding this much probability")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed (default: 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where there is one")


def cmd_generate(args, started_at: float) -> int:
    import torch

    from etrain.core.config import ConfigError
    from etrain.driver.generate import generate, load

    if not 0 <= args.temperature < math.inf or not 0 < args.top_p <= 1 or args.max_new_tokens < 1:  # nan: False
        raise ConfigError(
            f"--temperature must be a finite number >= 0 (got {args.temperature:g}), --top-p in (0, 1] (got "
            f"{args.top_p:g}), --max-new-tokens >= 1 (got {args.max_new_tokens})"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loaded = load(args.source, device)
    print(f"model: {loaded.source}", file=sys.stderr)
    codec = loaded.codec
    prompt = _chat_prompt(loaded, args.prompt) if args.chat else codec.encode(args.prompt)
    tokens = generate(loaded.model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, codec.eos)
    print(codec.decode(tokens) if args.chat else args.prompt + codec.decode(tokens))
    return 0


def _chat_prompt(loaded, message: str) -> list[int]:
    from etrain.core.config import ConfigError
    from etrain.data import chat

    if loaded.tokenizer_dir is None:
        raise ConfigError(f"--chat needs a chat template, and {loaded.source} was trained on bytes: it has none")
    return chat.prompt_tokens(loaded.tokenizer_dir, message)
