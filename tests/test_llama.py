"""The Llama family against `transformers` itself: tiny random models of each supported architecture (GQA, Llama
3.1's rope scaling, Qwen2's biases, tied and untied heads, drawn from a printed seed) load from their Hugging Face
directory and give `transformers`' logits; ours written back load in `transformers` and give ours; what is not
supported is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from etrain.core import checkpoint, hf
from etrain.core.config import ConfigError
from etrain.core.models import make_model

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def tiny_config(architecture: str, rng) -> transformers.PretrainedConfig:
    heads = rng.choice([4, 8])
    kv = rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])
    common = dict(
        vocab_size=rng.choice([64, 97]),
        hidden_size=8 * heads,
        intermediate_size=rng.choice([40, 64]),
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        tie_word_embeddings=rng.random() < 0.5,
        rms_norm_eps=1e-6,
    )
    print(architecture, common)
    if architecture == "LlamaForCausalLM":
        scaling = {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        }
        rope = {"rope_theta": 500_000.0, "rope_type": "llama3", **scaling} if rng.random() < 0.5 else None
        bias = rng.random() < 0.5
        print("rope", rope, "attention_bias", bias)
        return transformers.LlamaConfig(**common, rope_parameters=rope, attention_bias=bias, mlp_bias=bias)
    if architecture == "MistralForCausalLM":
        return transformers.MistralConfig(**common, sliding_window=None)
    return transformers.Qwen2Config(**common)


def reference(architecture: str, config, seed: int):
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # random biases and norms: a zero or a one would hide a name swapped
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.5 if "norm" in name else 0.0, 0.1)
    return model


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_hugging_face_directory_loads_and_gives_its_logits(architecture, rng, tmp_path):
    theirs = reference(architecture, tiny_config(architecture, rng), rng.randrange(2**31))
    theirs.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")  # an index of several files
    args = hf.read_config(tmp_path)
    ours = make_model(args).eval()
    ours.load_state_dict(hf.read_weights(tmp_path))  # strict: every tensor named and shaped alike
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(rng.randrange(99)))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(tokens), theirs(tokens).logits)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_ours_written_as_a_hugging_face_directory_loads_in_transformers(architecture, rng, tmp_path):
    source = reference(architecture, tiny_config(architecture, rng), rng.randrange(2**31))
    source.save_pretrained(tmp_path / "in")
    args = hf.read_config(tmp_path / "in")
    ours = make_model(args).eval()
    ours.load_state_dict(hf.read_weights(tmp_path / "in"))
    hf.write(ours.state_dict(), args, tmp_path / "out", shard_bytes=16 << 10)
    index = json.loads((tmp_path / "out" / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == ("Qwen2ForCausalLM" if architecture == "Qwen2ForCausalLM" else "LlamaForCausalLM")
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.logits(tokens))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act=gelu is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope type yarn"),
        ({"num_hidden_layers": None}, "has no 'num_hidden_layers'"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "does not describe a model this trainer builds"),
    ],
)
def test_what_the_model_does_not_implement_is_refused_by_name(change, named, rng, tmp_path):
    config = tiny_config("LlamaForCausalLM", rng)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved = {k: v for k, v in (saved | {"architectures": ["LlamaForCausalLM"]} | change).items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=named):
        hf.read_config(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        hf.read_config(tmp_path / "elsewhere")


def test_a_sliding_window_is_the_models_context(rng, tmp_path):
    """Mistral's sliding window shorter than its positions: within the window the attention is full, so the model
    reads with the window as its sequence length, gives transformers' logits there, and a longer run is refused."""
    from etrain.core.finetune import finetune_config

    config = tiny_config("MistralForCausalLM", rng)
    config.sliding_window = window = rng.choice([16, 24, 32])
    theirs = reference("MistralForCausalLM", config, rng.randrange(2**31))
    theirs.save_pretrained(tmp_path)
    args = hf.read_config(tmp_path)
    assert args.seq_len == window
    ours = make_model(args).eval()
    ours.load_state_dict(hf.read_weights(tmp_path))
    tokens = torch.randint(0, args.vocab_size, (2, window), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(tokens), theirs(tokens).logits)
    assert finetune_config(str(tmp_path), "tiny", [f"model.seq_len={window}"]).model.seq_len == window
    with pytest.raises(ConfigError, match=rf"model.seq_len=48 \(the base's: {window}\)"):
        finetune_config(str(tmp_path), "tiny", ["model.seq_len=48"])


def test_a_hugging_face_directory_is_a_fine_tuning_base(rng, tmp_path):
    """`etrain finetune --from DIR`: the run takes the directory's model (shorter sequences allowed, nothing else
    changed), records the weights' digest (read a tensor at a time), and builds the model with its weights; a longer
    sequence, another model or a changed file is refused by name."""
    from etrain.core.finetune import build_model, check_base, finetune_config

    architecture = rng.choice(ARCHITECTURES)
    theirs = reference(architecture, tiny_config(architecture, rng), rng.randrange(2**31))
    theirs.save_pretrained(tmp_path)
    cfg = finetune_config(str(tmp_path), "tiny", ["model.seq_len=32", "finetune.method=full"])
    assert cfg.model.family == "llama" and cfg.model.seq_len == 32 and cfg.finetune.base == str(tmp_path)
    assert cfg.finetune.base_digest == checkpoint.weights_digest(hf.read_weights(tmp_path))
    check_base(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(build_model(cfg).eval().logits(tokens), theirs(tokens).logits)

    lora = finetune_config(str(tmp_path), "tiny", ["model.seq_len=32"])  # LoRA: on the family's projections
    assert lora.finetune.lora.targets == ["attn.q", "attn.k", "attn.v", "attn.o"]
    check_base(lora)
    with pytest.raises(ConfigError, match=r"model.seq_len=128 \(the base's: 64\)"):
        finetune_config(str(tmp_path), "tiny", ["model.seq_len=128"])
    with pytest.raises(ConfigError, match=r"model.n_layer=3 \(the base's: 2\)"):
        finetune_config(str(tmp_path), "tiny", ["model.n_layer=3"])
    with torch.no_grad():
        theirs.model.norm.weight.add_(1.0)
    theirs.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="not the checkpoint this run was made from"):
        check_base(cfg)


def test_the_family_keys_are_checked_and_a_gpt_runs_identity_is_unchanged():
    from etrain.core.config import load_config

    gpt = load_config("tiny", [])
    body = gpt.model_dump()
    for key in ("family", "n_kv_head", "ffn_dim", "head_dim", "rope_theta", "rope_scaling", "norm_eps"):
        body["model"].pop(key)
    for key in ("qkv_bias", "o_bias", "mlp_bias"):
        body["model"].pop(key)
    assert load_config(body).hash() == gpt.hash()  # a run made before the family keys resumes
    with pytest.raises(ValueError, match=r"model.n_kv_head, model.qkv_bias apply to model.family=llama only"):
        load_config("tiny", ["model.n_kv_head=2", "model.qkv_bias=true"])
    with pytest.raises(ValueError, match=r"model.n_kv_head=3 must divide model.n_head=4"):
        load_config("tiny", ["model.family=llama", "model.n_kv_head=3"])
    with pytest.raises(ValueError, match=r"parallel.tp=2 must divide model.n_head=4 and its key/value heads \(1\)"):
        load_config("tiny", ["model.family=llama", "model.n_kv_head=1", "parallel.tp=2", "cluster.num_workers=2"])
    with pytest.raises(ValueError, match="model.family=llama has rotary positions and no dropout"):
        load_config("tiny", ["model.family=llama", "model.positions=learned"])
    llama = load_config("tiny", ["model.family=llama", "model.n_kv_head=2", "model.qkv_bias=true"])
    assert llama.finetune.lora.targets == ["attn.q", "attn.k", "attn.v", "attn.o"]
    assert llama.model.param_count() == make_model(llama.model).num_params()


def test_export_writes_a_llama_run_for_transformers_and_refuses_a_gpt_one(rng, tmp_path, capsys):
    """`etrain export --format hf` on a run's newest checkpoint (a run directory written here: config.yaml and a
    committed checkpoint), and `etrain generate` on the same run with its data's tokenizer (bytes)."""
    from etrain.cli import main
    from etrain.core.config import load_config

    for family in ("gpt", "llama"):
        extra = ["model.n_kv_head=2", f"model.tie_weights={rng.random() < 0.5}"] if family == "llama" else []
        cfg = load_config("tiny", [f"model.family={family}", *extra])
        run = tmp_path / family
        run.mkdir()
        (run / "config.yaml").write_text(cfg.to_yaml())
        torch.manual_seed(rng.randrange(2**31))
        model = make_model(cfg.model).eval()
        meta = {"config_hash": cfg.hash(), "cursor": 0}
        checkpoint.save(str(run / "checkpoints"), 4, {"model.pt": model.state_dict()}, meta, keep=1)
        out = tmp_path / f"{family}-hf"
        if family == "gpt":
            assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 2  # no such architecture
            assert not out.exists()
            continue
        assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            torch.testing.assert_close(theirs(tokens).logits, model.logits(tokens))
        capsys.readouterr()
        assert main(["generate", str(run), "--prompt", "def main", "--max-new-tokens", "8"]) == 0
        said = capsys.readouterr()
        assert said.out.startswith("def main") and f"model: file://{run}/checkpoints/step-00000004" in said.err


def test_a_hugging_face_directory_on_s3_is_read_a_tensor_at_a_time(s3_bucket, s3_faults, rng, tmp_path):
    """An s3:// directory is a base as a local one is: its config, its weights (ranged reads of each tensor's bytes,
    counted at the S3 server), the same digest; its tokenizer reads; a file cut short is refused naming it."""
    import fsspec

    from etrain.core.finetune import check_base, finetune_config
    from etrain.data import tokenizer
    from etrain.driver.generate import load

    architecture = rng.choice(ARCHITECTURES)
    theirs = reference(architecture, tiny_config(architecture, rng), rng.randrange(2**31))
    theirs.save_pretrained(tmp_path / "local", max_shard_size="20KB")
    tok = tokenizer.train_bpe(iter(["the cat sat on the mat. " * 4] * 8), theirs.config.vocab_size)
    (tmp_path / "local" / "tokenizer.json").write_text(tok.text)
    uri = f"{s3_bucket}/models/tiny"
    fs = fsspec.filesystem("s3")
    fs.put(str(tmp_path / "local") + "/", uri.removeprefix("s3://") + "/", recursive=True)
    assert hf.is_model_dir(uri) and not hf.is_model_dir(f"{s3_bucket}/elsewhere")
    assert hf.read_config(uri) == hf.read_config(tmp_path / "local")

    local, remote = hf.Weights(tmp_path / "local"), hf.Weights(uri)
    assert remote.shapes() == local.shapes()
    name = rng.choice(sorted(remote))
    s3_faults.reset()
    one = remote[name]
    assert torch.equal(one, local[name])
    read = [size for method, path, size in s3_faults.served if method == "GET" and "safetensors" in path]
    assert read == [one.numel() * one.element_size()]  # one ranged read of that tensor's bytes, not of its file
    cfg = finetune_config(uri, "tiny", ["finetune.method=full"])
    assert cfg.finetune.base == uri
    assert cfg.finetune.base_digest == checkpoint.weights_digest(hf.read_weights(tmp_path / "local"))
    check_base(cfg)
    loaded = load(uri, torch.device("cpu"))
    assert loaded.codec.encode("the cat") == tok.tokenizer.encode("the cat").ids
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.logits(tokens), theirs(tokens).logits)

    files = sorted(fs.glob(uri.removeprefix("s3://") + "/*.safetensors"))
    fs.pipe(files[-1], fs.cat(files[-1])[:-7])  # the last file cut short
    with pytest.raises(ConfigError, match="do not match its shape"):
        hf.read_weights(uri)
