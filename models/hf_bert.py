"""Mapping from megazero's BERT (models/bert.py, post-LayerNorm) to Hugging Face transformers'
BertForPreTraining: the fused [Q; K; V] projection becomes query/key/value, LayerNorms and heads
map one to one, the MLM decoder shares the word embedding (its bias is `cls.predictions.bias`).
The export holds the true vocabulary only: megazero's padding rows are not part of the model."""

from __future__ import annotations

import torch

from models.bert import BertConfig


def hf_config_dict(config: BertConfig, pad_token_id: int) -> dict:
    """config.json of the equivalent BertForPreTraining (vocabulary = the model's vocab_size, unpadded)."""
    if not config.post_layer_norm:
        raise ValueError("BertForPreTraining is post-LayerNorm; this model was trained with --pre-layer-norm")
    return {"architectures": ["BertForPreTraining"], "model_type": "bert", "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads, "intermediate_size": config.ffn_hidden_size,
            "hidden_act": "gelu", "hidden_dropout_prob": config.hidden_dropout_rate,
            "attention_probs_dropout_prob": config.attention_dropout_rate,
            "max_position_embeddings": config.max_position_embeddings or config.seq_length,
            "type_vocab_size": config.num_token_types,
            "initializer_range": config.init_method_std, "layer_norm_eps": config.layernorm_epsilon,
            "pad_token_id": pad_token_id,
            "tie_word_embeddings": True, "torch_dtype": "float32"}


def to_hf_state_dict(state: dict[str, torch.Tensor], config: BertConfig) -> dict[str, torch.Tensor]:
    """megazero BERT state dict (TP=1, global names) -> BertForPreTraining state dict (the word
    embedding and the MLM bias without their padding rows)."""
    vocab = config.vocab_size
    out = {"bert.embeddings.word_embeddings.weight": state["wte.weight"][:vocab],
           "bert.embeddings.position_embeddings.weight": state["wpe.weight"],
           "bert.embeddings.token_type_embeddings.weight": state["tte.weight"],
           "bert.embeddings.LayerNorm.weight": state["ln_emb.weight"],
           "bert.embeddings.LayerNorm.bias": state["ln_emb.bias"],
           "bert.pooler.dense.weight": state["pooler.weight"], "bert.pooler.dense.bias": state["pooler.bias"],
           "cls.predictions.transform.dense.weight": state["lm_dense.weight"],
           "cls.predictions.transform.dense.bias": state["lm_dense.bias"],
           "cls.predictions.transform.LayerNorm.weight": state["lm_ln.weight"],
           "cls.predictions.transform.LayerNorm.bias": state["lm_ln.bias"],
           "cls.predictions.bias": state["lm_bias"][:vocab],
           "cls.seq_relationship.weight": state["binary.weight"], "cls.seq_relationship.bias": state["binary.bias"]}
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}.", f"bert.encoder.layer.{i}."
        for name, w, b in zip(("query", "key", "value"), state[f"{ours}attn.qkv.weight"].chunk(3),
                              state[f"{ours}attn.qkv.bias"].chunk(3)):
            out[f"{theirs}attention.self.{name}.weight"], out[f"{theirs}attention.self.{name}.bias"] = w, b
        pairs = {"attention.output.dense": "attn.proj", "attention.output.LayerNorm": "ln_1",
                 "intermediate.dense": "fc", "output.dense": "proj", "output.LayerNorm": "ln_2"}
        for hf_name, our_name in pairs.items():
            out[f"{theirs}{hf_name}.weight"] = state[f"{ours}{our_name}.weight"]
            out[f"{theirs}{hf_name}.bias"] = state[f"{ours}{our_name}.bias"]
    return {k: v.contiguous() for k, v in out.items()}
