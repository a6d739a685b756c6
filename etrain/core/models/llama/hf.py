"""The Llama family's Hugging Face format: LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM's config.json
onto the model section (what the model does not implement refused by name), their tensors' names, and config.json
written back so that `transformers.AutoModelForCausalLM.from_pretrained` loads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from etrain.core.models.family import HFFormat

if TYPE_CHECKING:
    from etrain.core.config import ModelConfig

SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class LlamaFormat(HFFormat):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    block = {
        "self_attn.q_proj": "attn.q",
        "self_attn.k_proj": "attn.k",
        "self_attn.v_proj": "attn.v",
        "self_attn.o_proj": "attn.o",
        "mlp.gate_proj": "mlp.gate",
        "mlp.up_proj": "mlp.up",
        "mlp.down_proj": "mlp.down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "mlp_norm",
    }
    outside = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "head"}

    def read_config(self, config: dict, path: str, architecture: str) -> ModelConfig:
        """A sliding window (Mistral's) shorter than max_position_embeddings becomes the model's `seq_len`: within
        the window, sliding-window attention is full causal attention, so the model is exact there and a run may not
        go beyond it."""
        from etrain.core.config import ConfigError, ModelConfig

        arch = architecture
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"{path}: hidden_act={config['hidden_act']} is not supported (the Llama family's is silu)"
            )
        positions = config["max_position_embeddings"]
        mistral = arch == "MistralForCausalLM"
        window = config.get("sliding_window") if mistral or config.get("use_sliding_window") else None
        rope = config.get("rope_parameters") or {
            **(config.get("rope_scaling") or {}),
            "rope_theta": config.get("rope_theta"),
        }
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ConfigError(f"{path}: rope type {kind} is not supported (default and llama3 are)")
        bias = bool(config.get("attention_bias", False))
        return ModelConfig(
            family="llama",
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            n_layer=config["num_hidden_layers"],
            n_head=config["num_attention_heads"],
            n_kv_head=config.get("num_key_value_heads") or config["num_attention_heads"],
            ffn_dim=config["intermediate_size"],
            seq_len=min(positions, window) if window else positions,
            head_dim=config.get("head_dim"),
            rope_theta=float(rope.get("rope_theta") or 10_000.0),
            rope_scaling={k: rope[k] for k in SCALING} if kind == "llama3" else None,
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            qkv_bias=bias or arch == "Qwen2ForCausalLM",
            o_bias=bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            tie_weights=bool(config.get("tie_word_embeddings", False)),
        )

    def write_config(self, cfg: ModelConfig) -> dict:
        """LlamaForCausalLM's (Qwen2's biases on q, k and v alone are Llama's attention_bias only with o's too:
        such a model is written as Qwen2)."""
        qwen2 = cfg.qkv_bias and not cfg.o_bias
        theta = cfg.rope_theta or 10_000.0
        rope = {"rope_theta": theta, "rope_type": "default"}
        if cfg.rope_scaling is not None:
            rope |= {"rope_type": "llama3", **cfg.rope_scaling.model_dump()}
        return {
            "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen2 else "llama",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_width,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_width,
            "max_position_embeddings": cfg.seq_len,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps or 1e-5,
            "rope_theta": theta,
            "rope_scaling": None if cfg.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
            "rope_parameters": rope,
            "attention_bias": cfg.o_bias,
            "mlp_bias": cfg.mlp_bias,
            "tie_word_embeddings": cfg.tie_weights,
        }
