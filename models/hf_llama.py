"""Mapping between megazero's Llama (models/llama.py) and Hugging Face transformers' LlamaForCausalLM.

Both store linear weights output-by-input and rotate q/k by the same half-split pairing, so the
tensors map one to one, except that megazero fuses two pairs: its `attn.kv` is [k_proj; v_proj]
and its `mlp.fc` is [gate_proj; up_proj] (both stacked along the output rows). The export holds
the true vocabulary only (megazero's padding rows are not part of the model); an import pads it
again for the model config (zero rows). With tied embeddings there is no lm_head tensor.
"""

from __future__ import annotations

import torch

from models.llama import LlamaConfig

_NAMES = {"attn.q": "self_attn.q_proj", "attn.proj": "self_attn.o_proj", "mlp.proj": "mlp.down_proj",
          "norm_1": "input_layernorm", "norm_2": "post_attention_layernorm"}
_FUSED = {"attn.kv": ("self_attn.k_proj", "self_attn.v_proj"), "mlp.fc": ("mlp.gate_proj", "mlp.up_proj")}


def hf_config_dict(config: LlamaConfig, bos_token_id: int, eos_token_id: int) -> dict:
    """config.json of the equivalent LlamaForCausalLM (vocabulary = the model's vocab_size, unpadded)."""
    vocab = config.vocab_size
    for name, token in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if not 0 <= token < vocab:
            raise ValueError(f"{name} {token} is outside the vocabulary of {vocab}")
    theta = config.rope_theta
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "head_dim": config.hidden_size // config.num_attention_heads,
            "hidden_act": "silu", "max_position_embeddings": config.seq_length, "rms_norm_eps": config.norm_epsilon,
            "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": config.attention_dropout_rate,
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "initializer_range": config.init_method_std,
            "use_cache": True, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "dtype": "float32",
            "megazero_config": config.whole().to_dict()}


def to_hf_state_dict(state: dict[str, torch.Tensor], config: LlamaConfig, mlp: bool = True) -> dict[str, torch.Tensor]:
    """megazero Llama state dict (TP=1, global names) -> LlamaForCausalLM state dict (the word
    embedding and output layer without their padding rows). mlp False: every tensor but the MLPs'
    (what models/hf_mixtral.py shares)."""
    vocab = config.vocab_size
    out = {"model.embed_tokens.weight": state["wte.weight"][:vocab], "model.norm.weight": state["norm_f.weight"]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["lm_head.weight"][:vocab]
    names = {k: v for k, v in _NAMES.items() if mlp or not k.startswith("mlp.")}
    fused = {k: v for k, v in _FUSED.items() if mlp or not k.startswith("mlp.")}
    for i in range(config.num_layers):
        for ours, theirs in names.items():
            out[f"model.layers.{i}.{theirs}.weight"] = state[f"blocks.{i}.{ours}.weight"]
        for ours, (first, second) in fused.items():
            a, b = state[f"blocks.{i}.{ours}.weight"].chunk(2, dim=0)
            out[f"model.layers.{i}.{first}.weight"], out[f"model.layers.{i}.{second}.weight"] = a, b
    return {name: t.contiguous() for name, t in out.items()}


def _padded(rows: torch.Tensor, config: LlamaConfig, name: str) -> torch.Tensor:
    """A vocabulary tensor with zero rows up to the config's padded vocabulary."""
    if rows.shape[0] != config.vocab_size:
        raise ValueError(f"{name} has {rows.shape[0]} rows; the model config's vocab_size is {config.vocab_size}")
    return torch.cat([rows, rows.new_zeros(config.padded_vocab_size - rows.shape[0], rows.shape[1])])


def _rope_theta(hf_config: dict) -> float:
    parameters = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    kind = parameters.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"rope type {kind!r}: megazero's Llama has plain rotary embeddings only")
    return float(parameters.get("rope_theta", hf_config.get("rope_theta", 10000.0)))


def config_from_hf(hf_config: dict, model_type: str = "llama", **fields) -> LlamaConfig:
    """A megazero LlamaConfig (TP=1) for a LlamaForCausalLM config.json (or, with model_type, a
    config of the same attention and norms: models/hf_mixtral.py, `fields` its MoE ones); errors
    name what differs."""
    if hf_config.get("model_type") != model_type:
        raise ValueError(f"expected a {model_type} config, got model_type {hf_config.get('model_type')!r}")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf_config.get(key, expected) != expected:
            raise ValueError(f"{key} {hf_config[key]!r}: megazero's Llama needs {expected!r}")
    heads, hidden = hf_config["num_attention_heads"], hf_config["hidden_size"]
    if hf_config.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"head_dim {hf_config['head_dim']} must be hidden_size / num_attention_heads "
                         f"({hidden // heads})")
    if "megazero_config" in hf_config:  # exported by megazero: the same model config back
        return LlamaConfig(**hf_config["megazero_config"])
    return LlamaConfig(vocab_size=hf_config["vocab_size"], seq_length=hf_config["max_position_embeddings"],
                       num_layers=hf_config["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=hf_config.get("num_key_value_heads") or heads,
                       ffn_hidden_size=hf_config["intermediate_size"], rope_theta=_rope_theta(hf_config),
                       norm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
                       untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", False),
                       **fields)


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor]) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """LlamaForCausalLM config.json + state dict -> megazero LlamaConfig (TP=1) and state dict."""
    config = config_from_hf(hf_config)
    return config, state_from_hf(hf_state, config)


def state_from_hf(hf_state: dict[str, torch.Tensor], config: LlamaConfig, mlp: bool = True) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict -> megazero's for `config` (mlp False: all but the MLPs')."""
    state = {"wte.weight": _padded(hf_state["model.embed_tokens.weight"], config, "model.embed_tokens.weight"),
             "norm_f.weight": hf_state["model.norm.weight"]}
    if config.untie_embeddings_and_output_weights:
        state["lm_head.weight"] = _padded(hf_state["lm_head.weight"], config, "lm_head.weight")
    names = {k: v for k, v in _NAMES.items() if mlp or not k.startswith("mlp.")}
    fused = {k: v for k, v in _FUSED.items() if mlp or not k.startswith("mlp.")}
    for i in range(config.num_layers):
        for ours, theirs in names.items():
            state[f"blocks.{i}.{ours}.weight"] = hf_state[f"model.layers.{i}.{theirs}.weight"]
        for ours, (first, second) in fused.items():
            state[f"blocks.{i}.{ours}.weight"] = torch.cat([hf_state[f"model.layers.{i}.{first}.weight"],
                                                            hf_state[f"model.layers.{i}.{second}.weight"]])
    return {name: t.contiguous() for name, t in state.items()}
