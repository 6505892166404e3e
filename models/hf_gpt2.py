"""Mapping between megazero's GPT (models/gpt.py) and Hugging Face transformers' GPT2LMHeadModel.

Hugging Face's GPT-2 stores attention and MLP weights input-by-output (its `Conv1D`), so every
linear weight is transposed; the fused attention projection keeps megazero's [Q; K; V] order; the
output layer shares the word embedding (not stored separately). Both use tanh-approximated GeLU
("gelu_new") and pre-LayerNorm blocks, so logits agree to float rounding. The export holds the
true vocabulary only (megazero's padding rows are not part of the model); an import pads it
again for the model config (zero rows).
"""

from __future__ import annotations

import torch

from models.gpt import GPTConfig

_LINEARS = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_NORMS = {"ln_1": "ln_1", "ln_2": "ln_2"}


def hf_config_dict(config: GPTConfig, bos_token_id: int, eos_token_id: int) -> dict:
    """config.json of the equivalent GPT2LMHeadModel (vocabulary = the model's vocab_size, unpadded)."""
    if config.ffn_hidden_size != 4 * config.hidden_size:
        raise ValueError(f"GPT-2 needs ffn_hidden_size = 4 x hidden_size, got {config.ffn_hidden_size}")
    vocab = config.vocab_size
    for name, token in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if not 0 <= token < vocab:
            raise ValueError(f"{name} {token} is outside the vocabulary of {vocab}")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
            "n_positions": config.max_position_embeddings or config.seq_length,
            "n_embd": config.hidden_size, "n_layer": config.num_layers,
            "n_head": config.num_attention_heads, "n_inner": None, "activation_function": "gelu_new",
            "resid_pdrop": config.hidden_dropout_rate, "embd_pdrop": config.hidden_dropout_rate,
            "attn_pdrop": config.attention_dropout_rate,
            "layer_norm_epsilon": config.layernorm_epsilon, "initializer_range": config.init_method_std,
            "scale_attn_weights": True,
            "use_cache": True, "tie_word_embeddings": True, "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id, "torch_dtype": "float32",
            "megazero_config": config.whole().to_dict()}


def name_pairs(num_layers: int):
    """(megazero name, transformers name, transposed) for every tensor of the model."""
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        yield name, f"transformer.{name}", False
    for i in range(num_layers):
        for ours, theirs, transposed in [(a, b, False) for a, b in _NORMS.items()] + \
                [(a, b, True) for a, b in _LINEARS.items()]:  # Conv1D weights are input x output
            yield f"blocks.{i}.{ours}.weight", f"transformer.h.{i}.{theirs}.weight", transposed
            yield f"blocks.{i}.{ours}.bias", f"transformer.h.{i}.{theirs}.bias", False


def to_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """megazero GPT state dict (TP=1, global names) -> GPT2LMHeadModel state dict (no lm_head: tied;
    the word embedding without its padding rows)."""
    state = {**state, "wte.weight": state["wte.weight"][:config.vocab_size]}
    return {theirs: (state[ours].t() if transposed else state[ours]).contiguous()
            for ours, theirs, transposed in name_pairs(config.num_layers)}


def _padded_embedding(wte: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """The imported word embedding with zero rows up to the config's padded vocabulary (a file
    exported before megazero stopped exporting its padding already has them)."""
    if not config.vocab_size <= wte.shape[0] <= config.padded_vocab_size:
        raise ValueError(f"the word embedding has {wte.shape[0]} rows; the model config expects vocab_size "
                         f"{config.vocab_size} (padded to {config.padded_vocab_size})")
    return torch.cat([wte, wte.new_zeros(config.padded_vocab_size - wte.shape[0], wte.shape[1])])


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor]) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """GPT2LMHeadModel config.json + state dict -> megazero GPTConfig (TP=1) and state dict."""
    if hf_config.get("model_type") != "gpt2":
        raise ValueError(f"expected a gpt2 config, got model_type {hf_config.get('model_type')!r}")
    if hf_config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function {hf_config['activation_function']!r}: megazero's GPT uses "
                         f"tanh-approximated GeLU")
    if hf_config.get("n_inner") not in (None, 4 * hf_config["n_embd"]):
        raise ValueError(f"n_inner {hf_config['n_inner']} must be 4 x n_embd")
    vocab = hf_config["vocab_size"]
    if "megazero_config" in hf_config:  # exported by megazero: the same model config back
        config = GPTConfig(**hf_config["megazero_config"])
    else:  # any GPT-2: its vocabulary, padded as megazero pads (50,257 -> 50,304), so any TP size splits it
        config = GPTConfig(vocab_size=vocab, seq_length=hf_config["n_positions"], num_layers=hf_config["n_layer"],
                           hidden_size=hf_config["n_embd"], num_attention_heads=hf_config["n_head"],
                           layernorm_epsilon=hf_config["layer_norm_epsilon"])
    if not config.vocab_size <= vocab <= config.padded_vocab_size:
        raise ValueError(f"vocab_size {vocab} does not match the model config's vocab_size {config.vocab_size}")
    # older GPT-2 files store the transformer's tensors without the "transformer." prefix
    hf_state = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in hf_state.items()}
    state = {ours: (hf_state[theirs].t() if transposed else hf_state[theirs]).contiguous()
             for ours, theirs, transposed in name_pairs(config.num_layers)}
    state["wte.weight"] = _padded_embedding(state["wte.weight"], config)
    return config, state
