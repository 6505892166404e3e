"""Mapping between megazero's MoE Llama (models/llama.py with num_experts) and Hugging Face
transformers' MixtralForCausalLM.

Attention, norms, embedding and output layer are the Llama's (models/hf_llama.py). Each layer's
MoE maps as:

    blocks.{i}.mlp.router.weight        [E, H]       block_sparse_moe.gate.weight
    blocks.{i}.mlp.experts.fc1_weight   [E, 2F, H]   expert j's rows [:F] w1 (gate), [F:] w3 (up)
    blocks.{i}.mlp.experts.fc2_weight   [E, H, F]    expert j's w2 (down)

under model.layers.{i}. (the Hub's layout, w1/w2/w3 per expert, which every transformers version
loads; transformers 5 fuses them on load into mlp.experts.gate_up_proj [E, 2F, H] = [w1; w3] and
down_proj, which an import reads too). The consolidated checkpoint holds the experts in global
order whatever the EP size it was trained at, so row j is expert j.

What maps, and what does not (errors and warnings name the model-config key):
- Routing. Mixtral: softmax over all experts, top-k, the k weights renormalised to sum to one,
  i.e. softmax over the k largest logits: megazero's moe_router_score_order "topk_softmax"
  (softmax is monotonic, so both pick the same experts; ties break to the lower index in both).
  "softmax_topk" (megazero's default) weights each expert by its softmax over all experts,
  without renormalising: the weights differ by the token's factor sum of its k probabilities
  (< 1 unless k = E), which no change of weights can absorb, so it is refused (with k = E the two
  are identical and it is converted).
- Dropping. Mixtral is dropless: a checkpoint with moe_capacity_factor exports with a warning,
  its logits those of the same model run dropless (megazero with moe_capacity_factor null), which
  differ from the capacity-mode model's wherever that drops tokens.
- Layers. Mixtral has experts in every layer: moe_layer_freq must be 1.
The auxiliary-loss weight goes to router_aux_loss_coef (used by transformers only with
output_router_logits); the z-loss has no Mixtral counterpart (it does not change the logits).
"""

from __future__ import annotations

import warnings

import torch

from models import hf_llama
from models.llama import LlamaConfig

MIXTRAL_SCORE_ORDER = "topk_softmax"


def check_exportable(config: LlamaConfig) -> None:
    """Raise where `config` (an MoE Llama) has no MixtralForCausalLM with its logits; warn for a
    capacity factor (see the module docstring)."""
    check_mappable(config)
    if config.moe_capacity_factor is not None:
        warnings.warn(f"moe_capacity_factor {config.moe_capacity_factor}: this model drops routing assignments over "
                      f"an expert's capacity, but MixtralForCausalLM is dropless: the export computes every "
                      f"assignment (megazero's logits at moe_capacity_factor null), so its logits differ wherever "
                      f"the capacity-mode model drops tokens", stacklevel=2)


def check_mappable(config: LlamaConfig) -> None:
    """Raise where `config`'s layers or routing differ from Mixtral's (see the module docstring)."""
    if config.num_experts is None:
        raise ValueError("num_experts is null: a dense Llama is a LlamaForCausalLM, not a Mixtral")
    if config.moe_layer_freq != 1:
        raise ValueError(f"moe_layer_freq {config.moe_layer_freq}: MixtralForCausalLM has experts in every layer, "
                         f"so only moe_layer_freq 1 exports (this model has dense MLPs between its MoE layers)")
    order, k, experts = config.moe_router_score_order, config.moe_router_topk, config.num_experts
    if order != MIXTRAL_SCORE_ORDER and k != experts:
        raise ValueError(f"moe_router_score_order {order!r}: its expert weights are softmax probabilities over all "
                         f"{experts} experts, not renormalised over the top {k} as Mixtral's are (a per-token "
                         f"factor, so not convertible); train with moe_router_score_order "
                         f"{MIXTRAL_SCORE_ORDER!r} to export as MixtralForCausalLM")


def hf_config_dict(config: LlamaConfig, bos_token_id: int, eos_token_id: int) -> dict:
    """config.json of the equivalent MixtralForCausalLM (vocabulary = the model's vocab_size, unpadded)."""
    out = hf_llama.hf_config_dict(config, bos_token_id, eos_token_id)
    for key in ("attention_bias", "mlp_bias"):  # Mixtral has neither (and no such keys)
        out.pop(key)
    out.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=config.num_experts,
               num_experts_per_tok=config.moe_router_topk, router_aux_loss_coef=config.moe_aux_loss_coeff,
               output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """megazero MoE Llama state dict (TP=1, global names and expert indices) -> MixtralForCausalLM's."""
    check_mappable(config)
    out = hf_llama.to_hf_state_dict(state, config, mlp=False)
    ffn = config.ffn_hidden_size
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        out[theirs + "gate.weight"] = state[ours + "router.weight"].contiguous()
        fc1, fc2 = state[ours + "experts.fc1_weight"], state[ours + "experts.fc2_weight"]
        if fc1.shape[0] != config.num_experts:
            raise ValueError(f"{ours}experts.fc1_weight holds {fc1.shape[0]} experts, the config num_experts "
                             f"{config.num_experts}")
        for j in range(config.num_experts):
            out[f"{theirs}experts.{j}.w1.weight"] = fc1[j, :ffn].contiguous()
            out[f"{theirs}experts.{j}.w3.weight"] = fc1[j, ffn:].contiguous()
            out[f"{theirs}experts.{j}.w2.weight"] = fc2[j].contiguous()
    return out


def config_from_hf(hf_config: dict) -> LlamaConfig:
    """A megazero MoE LlamaConfig (TP=1) for a MixtralForCausalLM config.json."""
    if hf_config.get("sliding_window") is not None:
        raise ValueError(f"sliding_window {hf_config['sliding_window']}: megazero's Llama attends to the whole "
                         f"sequence")
    return hf_llama.config_from_hf(hf_config, "mixtral", num_experts=hf_config["num_local_experts"],
                                   moe_router_topk=hf_config.get("num_experts_per_tok", 2),
                                   moe_router_score_order=MIXTRAL_SCORE_ORDER,
                                   moe_aux_loss_coeff=hf_config.get("router_aux_loss_coef", 0.001))


def _experts(hf_state: dict[str, torch.Tensor], layer: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s stacked [E, 2F, H] ([gate; up]) and [E, H, F] expert weights, from either layout."""
    fused = f"model.layers.{layer}.mlp.experts."
    if fused + "gate_up_proj" in hf_state:  # transformers 5's own save_pretrained
        return hf_state[fused + "gate_up_proj"], hf_state[fused + "down_proj"]
    prefix = f"model.layers.{layer}.block_sparse_moe.experts."
    fc1 = torch.stack([torch.cat([hf_state[f"{prefix}{j}.w1.weight"], hf_state[f"{prefix}{j}.w3.weight"]])
                       for j in range(num_experts)])
    return fc1, torch.stack([hf_state[f"{prefix}{j}.w2.weight"] for j in range(num_experts)])


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor]) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """MixtralForCausalLM config.json + state dict -> megazero MoE LlamaConfig (TP=1) and state dict."""
    config = config_from_hf(hf_config)
    check_mappable(config)  # e.g. an edited megazero_config of another score order
    state = hf_llama.state_from_hf(hf_state, config, mlp=False)
    for i in range(config.num_layers):
        gate = f"model.layers.{i}.block_sparse_moe.gate.weight"
        gate = gate if gate in hf_state else f"model.layers.{i}.mlp.gate.weight"
        state[f"blocks.{i}.mlp.router.weight"] = hf_state[gate].contiguous()
        fc1, fc2 = _experts(hf_state, i, config.num_experts)
        state[f"blocks.{i}.mlp.experts.fc1_weight"], state[f"blocks.{i}.mlp.experts.fc2_weight"] = (
            fc1.contiguous(), fc2.contiguous())
    return config, state
