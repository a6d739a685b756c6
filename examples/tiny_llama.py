"""A tiny random Llama as a Hugging Face directory, with a byte-level BPE tokenizer learned from this repository's
README: what docs/models.md's "Bring your model" runs end to end in seconds, in place of a real model's directory.

    python examples/tiny_llama.py models/tiny-llama [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from etrain.core import hf
from etrain.core.config import ModelConfig
from etrain.core.models import make_model
from etrain.data import tokenizer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a new or empty directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; name a new directory")
    text = (ROOT / "README.md").read_text()
    tok = tokenizer.train_bpe(iter(text.split("\n\n")), vocab_size=512)
    cfg = ModelConfig(
        family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=64, ffn_dim=192, seq_len=256,
        vocab_size=tok.vocab_size, tie_weights=False, rope_theta=10_000.0,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    hf.write(make_model(cfg).state_dict(), cfg, out)
    (out / tokenizer.FILE).write_text(tok.text)
    print(f"{out}: a {cfg.param_count():,}-parameter Llama, a {tok.vocab_size}-token tokenizer")


if __name__ == "__main__":
    main()
