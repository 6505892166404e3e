"""The MoE Llama and transformers' MixtralForCausalLM (models/hf_mixtral.py): a checkpoint trained
at EP=2 on DP=2 (experts stored under global indices) exports to a directory transformers loads with
megazero's logits (fp32, within 1e-5), and import(export(x)) is exact; a random MixtralForCausalLM
saved by transformers imports with its logits; a capacity-factor checkpoint exports with a warning
and the dropless model's logits; the settings Mixtral cannot express are refused naming their key."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megazero.checkpoint.model_files import load_model, write_weights_checkpoint
from models import hf_mixtral
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests.conftest import CORPUS_PREFIX
from tests.hf_helpers import require_transformers
from tests.training_helpers import FAMILY, TINY_LLAMA, base_config, train

TOKENIZER = CORPUS_PREFIX + "_tokenizer.model"
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_router_score_order": "topk_softmax"}
SHAPE = dict(TINY_LLAMA)  # the tiny Llama as trained (dropout on); logits are compared in eval mode
# the corpus tokenizer (8,000 pieces) with the tiny models' 256 rows: export_hf's mismatch warning, expected here
pytestmark = pytest.mark.filterwarnings("ignore:the tokenizer .* has 8000 tokens:UserWarning")


def _export(load: str, out: str) -> str:
    from scripts.export_hf import main as export

    return export(["--load", load, "--out", out, "--tokenizer-model", TOKENIZER])


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))


def _random_checkpoint(tmp_path, name: str, config, model_class=Llama) -> str:
    """A weights-only checkpoint of a seeded random `model_class(config)`."""
    torch.manual_seed(0)
    save = str(tmp_path / name)
    write_weights_checkpoint(config, model_class(config).state_dict(), save, model_class=model_class)
    return save


def _hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import MixtralForCausalLM

    hf = MixtralForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return hf(ids).logits


def test_ep2_checkpoint_exports_with_transformers_logits_and_imports_back_exactly(
        pools, token_dataset_prefix_module, tmp_path):
    require_transformers()
    from safetensors.torch import load_file

    from scripts.import_hf import main as import_hf

    save = str(tmp_path / "ep2")
    overrides = {FAMILY: "llama", **MOE}  # TINY_LLAMA's shape, dropout on in training
    config = base_config(train_micro_batch_size_per_gpu=4, zero_optimization={"stage": 1})
    pools(2).run(train, config, token_dataset_prefix_module, 2, 0, save, 2, None, overrides, (1, 1, 2))
    hf_dir = _export(save, str(tmp_path / "hf"))
    ours = load_model(save, model_class=Llama, config_class=LlamaConfig)
    assert ours.config.num_experts == 4
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        expected = ours(ids)
    torch.testing.assert_close(_hf_logits(hf_dir, ids), expected, rtol=1e-5, atol=1e-5)

    import_hf(["--hf-dir", hf_dir, "--save", str(tmp_path / "imported")])
    again = load_file(os.path.join(_export(str(tmp_path / "imported"), str(tmp_path / "hf2")), "model.safetensors"))
    first = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_transformers_mixtral_imports_with_its_logits(tmp_path):
    require_transformers()
    from transformers import MixtralConfig, MixtralForCausalLM

    from scripts.import_hf import main as import_hf

    torch.manual_seed(0)
    hf = MixtralForCausalLM(MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6))
    hf.eval().save_pretrained(str(tmp_path / "hf"))  # the Hub's layout: w1/w2/w3 per expert
    import_hf(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "imported")])
    ours = load_model(str(tmp_path / "imported"), model_class=Llama, config_class=LlamaConfig)
    assert (ours.config.num_experts, ours.config.moe_router_score_order) == (4, "topk_softmax")
    ids = _ids(256, 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    # transformers 5's in-memory layout (experts fused into gate_up_proj / down_proj) gives the same tensors
    _, fused = hf_mixtral.from_hf(hf.config.to_dict(), hf.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    assert all(torch.equal(fused[name], value) for name, value in ours.state_dict().items())


def test_capacity_factor_warns_and_exports_the_dropless_model(tmp_path):
    require_transformers()
    config = LlamaConfig(**SHAPE, **MOE, moe_capacity_factor=0.5)  # half the average load: it drops
    save = _random_checkpoint(tmp_path, "capacity", config)
    with pytest.warns(UserWarning, match="moe_capacity_factor 0.5: .* MixtralForCausalLM is dropless"):
        hf_dir = _export(save, str(tmp_path / "hf"))
    capacity = load_model(save, model_class=Llama, config_class=LlamaConfig)
    dropless = Llama(dataclasses.replace(capacity.config, moe_capacity_factor=None)).eval()
    dropless.load_state_dict(capacity.state_dict())
    ids = _ids(config.vocab_size, 2)
    with torch.no_grad():
        hf = _hf_logits(hf_dir, ids)
        torch.testing.assert_close(hf, dropless(ids), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(hf, capacity(ids), rtol=1e-3, atol=1e-3)  # what the warning says


def test_softmax_topk_converts_only_where_it_is_mixtrals(tmp_path):
    require_transformers()
    default = _random_checkpoint(tmp_path, "default", LlamaConfig(**SHAPE, num_experts=4))
    with pytest.raises(ValueError, match="moe_router_score_order 'softmax_topk': .* not renormalised"):
        _export(default, str(tmp_path / "hf_default"))
    # top-2 of 2 experts: the probabilities of all experts already sum to one, the same weights
    config = LlamaConfig(**SHAPE, num_experts=2, moe_router_topk=2)
    save = _random_checkpoint(tmp_path, "all_experts", config)
    hf_dir = _export(save, str(tmp_path / "hf"))
    ids = _ids(config.vocab_size, 3)
    with torch.no_grad():
        expected = load_model(save, model_class=Llama, config_class=LlamaConfig)(ids)
    torch.testing.assert_close(_hf_logits(hf_dir, ids), expected, rtol=1e-5, atol=1e-5)


def test_settings_mixtral_has_not_are_refused(tmp_path):
    every_other = _random_checkpoint(tmp_path, "freq2", LlamaConfig(**SHAPE, **MOE, moe_layer_freq=2))
    with pytest.raises(ValueError, match="moe_layer_freq 2: MixtralForCausalLM has experts in every layer"):
        _export(every_other, str(tmp_path / "hf_freq2"))
    gpt_shape = {k: v for k, v in SHAPE.items() if k not in ("num_query_groups", "ffn_hidden_size")}
    gpt = _random_checkpoint(tmp_path, "gpt", GPTConfig(**gpt_shape, num_experts=4), GPT)
    with pytest.raises(ValueError, match="GPT has MoE layers .* no GPT-2 with experts"):
        _export(gpt, str(tmp_path / "hf_gpt"))
    with pytest.raises(ValueError, match="moe_router_score_order must be one of"):
        LlamaConfig(**SHAPE, num_experts=4, moe_router_score_order="sigmoid")
