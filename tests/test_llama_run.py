"""The Llama family in the trainer, on the session's Ray: a Hugging Face directory trained further on two
data-parallel workers (`etrain train --init-from`) and fine-tuned with LoRA, each exported back as a Hugging Face
directory whose logits in `transformers` are the run's."""

from __future__ import annotations

import pytest
import torch
import transformers

from app.cli import main
from app.core import checkpoint
from app.core.checkpoint import checkpoint_uri, load_latest
from app.core.finetune import build_model, finetune_config, load_trained_state
from app.core.lora import merged_state

from runs import FAST, records

pytestmark = pytest.mark.usefixtures("ray_session")


def test_a_hugging_face_llama_trains_fine_tunes_and_goes_back_to_transformers(data_dir, tmp_path, rng):
    kv = rng.choice([1, 2, 4])
    print("key/value heads:", kv)
    source = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv, max_position_embeddings=256, tie_word_embeddings=rng.random() < 0.5,
    )  # fmt: skip
    torch.manual_seed(rng.randrange(2**31))
    transformers.LlamaForCausalLM(source).save_pretrained(tmp_path / "hf")
    data = [f"data.cache_dir={data_dir}", "data.corpus_bytes=1500000", "data.shard_bytes=200000"]
    common = [*data, *FAST, f"run.root={tmp_path / 'runs'}", "model.seq_len=64", "train.steps=8"]

    for name, workers, extra in (("full", 2, []), ("lora", 1, ["finetune.method=lora", "optim.lr=1e-2"])):
        args = ["--set", *common, f"run.name={name}", f"cluster.num_workers={workers}", *extra]
        if name == "full":  # continued pre-training
            assert main(["train", "--init-from", str(tmp_path / "hf"), "--config", "tiny", "--no-progress", *args]) == 0
        else:
            assert main(["finetune", "--from", str(tmp_path / "hf"), "--config", "tiny", "--no-progress", *args]) == 0
        run_dir = tmp_path / "runs" / name
        losses = [r["loss"] for r in records(run_dir, "train")]
        assert len(losses) == 8 and losses[-1] < losses[0]
        out = tmp_path / f"{name}-hf"
        assert (
            main(["export", str(run_dir), "--format", "hf", "--out", str(out), *(["--merge"] * (name == "lora"))]) == 0
        )

        cfg = finetune_config(str(tmp_path / "hf"), "tiny", [*common, *extra])
        ours = build_model(cfg).eval()
        load_trained_state(ours, checkpoint.model_weights(load_latest(checkpoint_uri(cfg, run_dir)).parts))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(theirs(tokens).logits, ours.logits(tokens), rtol=1e-4, atol=1e-5)
        if name == "lora":  # adapters on the attention's four projections, merged into them
            assert any(n.endswith("attn.o.lora_a") for n in ours.state_dict()) and merged_state(ours)
