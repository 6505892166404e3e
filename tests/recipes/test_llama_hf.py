"""The Llama and Hugging Face transformers' LlamaForCausalLM: checkpoints trained at TP=1 (DP=2,
ZeRO-3), TP=2 with the key/value heads split and replicated, and PP=2 (tied embeddings) export
to a directory transformers loads with the same logits and AutoTokenizer loads with megazero's
ids; import(export(x)) is exact; a random LlamaForCausalLM saved by transformers imports with its
own logits, and an engine at TP=2 continues training from it; evaluate.py --text-file gives
transformers' loss on the exported model."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.nn.functional as F

from megazero.checkpoint.model_files import load_model
from models.llama import Llama, LlamaConfig
from tests.conftest import CORPUS_PREFIX, REPO
from tests.hf_helpers import require_transformers, transformers_windowed_loss
from tests.training_helpers import FAMILY, base_config, build_engine, global_mean, train

TOKENIZER = CORPUS_PREFIX + "_tokenizer.model"
LLAMA = {FAMILY: "llama", "vocab_size": 8000}  # the corpus tokenizer's vocabulary, so its ids fit
# name: ((TP, PP), ZeRO stage, micro-batch size, model overrides)
LAYOUTS = {"tp1_dp2_zero3": ((1, 1), 3, 4, LLAMA),
           "tp2_kv_split": ((2, 1), 1, 8, LLAMA),
           "tp2_kv_replicated": ((2, 1), 2, 8, {**LLAMA, "num_query_groups": 1}),
           "pp2_tied": ((1, 2), 0, 2, {**LLAMA, "untie_embeddings_and_output_weights": False})}


@pytest.fixture(scope="module")
def checkpoints(pools, token_dataset_prefix_module, tmp_path_factory) -> dict[str, str]:
    """Each layout's checkpoint after 3 steps."""
    out = {}
    for name, (layout, stage, micro, overrides) in LAYOUTS.items():
        save = str(tmp_path_factory.mktemp(name))
        config = base_config(train_micro_batch_size_per_gpu=micro,
                             zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0})
        pools(2).run(train, config, token_dataset_prefix_module, 3, 0, save, 3, None, overrides, layout)
        out[name] = save
    return out


def _export(load: str, out: str) -> str:
    from scripts.export_hf import main as export

    return export(["--load", load, "--out", out, "--tokenizer-model", TOKENIZER])


def _text() -> str:
    """Real text: the opening of a play from the corpus."""
    return open(sorted(glob.glob(os.path.join(REPO, "data", "shakespeare", "*.txt")))[0]).read()[:6000]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_export_gives_transformers_logits_and_imports_back_exactly(checkpoints, corpus_prefix, tmp_path, name):
    require_transformers()
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from scripts.import_hf import main as import_hf

    hf_dir = _export(checkpoints[name], str(tmp_path / "hf"))
    hf = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ours = load_model(checkpoints[name], model_class=Llama, config_class=LlamaConfig)
    assert hf.config.num_key_value_heads == ours.config.num_query_groups
    ids = torch.randint(0, 8000, (2, ours.config.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)

    import_hf(["--hf-dir", hf_dir, "--save", str(tmp_path / "imported")])
    again = load_file(os.path.join(_export(str(tmp_path / "imported"), str(tmp_path / "hf2")), "model.safetensors"))
    first = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_exported_tokenizer_gives_megazero_ids(checkpoints, corpus_prefix, tmp_path):
    require_transformers()
    from transformers import AutoTokenizer

    from megazero.data import SentencePieceTokenizer

    hf = AutoTokenizer.from_pretrained(_export(checkpoints["tp2_kv_split"], str(tmp_path / "hf")))
    text = _text() + "\n\n  two  spaces, tabs\t and unicode: café — ½ ✓\n"
    assert hf(text)["input_ids"] == SentencePieceTokenizer(TOKENIZER).encode(text)
    assert hf.decode(hf(text)["input_ids"]) == text


def test_evaluate_text_file_matches_transformers(checkpoints, corpus_prefix, tmp_path):
    require_transformers()
    from transformers import AutoTokenizer, LlamaForCausalLM

    from scripts.evaluate import main as evaluate

    text_file = tmp_path / "play.txt"
    text_file.write_text(_text()[:3000])
    result = evaluate(["--load", checkpoints["tp2_kv_replicated"], "--text-file", str(text_file),
                       "--tokenizer-model", TOKENIZER])
    hf_dir = _export(checkpoints["tp2_kv_replicated"], str(tmp_path / "hf"))
    hf, tokenizer = LlamaForCausalLM.from_pretrained(hf_dir).eval(), AutoTokenizer.from_pretrained(hf_dir)
    ids = torch.tensor(tokenizer(text_file.read_text())["input_ids"])
    assert result["tokens"] == len(ids) - 1
    expected = transformers_windowed_loss(hf, ids, hf.config.max_position_embeddings)
    assert result["loss"] == pytest.approx(expected, rel=1e-4)


# a random LlamaForCausalLM of TINY_LLAMA's shape, with its own rotary base and RMSNorm epsilon
HF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False)
HF_THETA = 5000.0
ENGINE_OVERRIDES = {FAMILY: "llama", "dropout": 0.1, "rope_theta": HF_THETA, "norm_epsilon": 1e-6}  # loss in eval mode


def _loss_then_continue(prefix: str, load_dir: str, ids: torch.Tensor) -> dict:
    """At TP=2: the loaded model's loss on `ids` (eval mode), then 2 training steps."""
    config = base_config(train_micro_batch_size_per_gpu=8, zero_optimization={"stage": 1})
    engine, loader = build_engine(config, prefix, 0, ENGINE_OVERRIDES, (2, 1))
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None and engine.global_steps == 0
    engine.module.eval()
    with torch.no_grad():
        loss = float(engine.module(ids[:, :-1], labels=ids[:, 1:]))
    engine.module.train()
    data = iter(loader)
    return {"loss": loss, "losses": [global_mean(engine.train_batch(data).item(), engine) for _ in range(2)]}


def test_transformers_model_imports_with_its_logits(pools, token_dataset_prefix_module, tmp_path):
    require_transformers()
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from scripts.import_hf import main as import_hf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(HFLlamaConfig(**HF_SHAPE, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": HF_THETA})).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    import_hf(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "imported")])
    ours = load_model(str(tmp_path / "imported"), model_class=Llama, config_class=LlamaConfig)
    assert (ours.config.num_query_groups, ours.config.rope_theta, ours.config.norm_epsilon) == (2, HF_THETA, 1e-6)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[:, :-1]).logits
        torch.testing.assert_close(ours(ids[:, :-1]), expected, rtol=1e-5, atol=1e-5)
        hf_loss = float(F.cross_entropy(expected.reshape(-1, 256), ids[:, 1:].reshape(-1)))
    for result in pools(2).run(_loss_then_continue, token_dataset_prefix_module, str(tmp_path / "imported"), ids):
        assert result["loss"] == pytest.approx(hf_loss, rel=1e-5)
        assert len(result["losses"]) == 2 and all(0 < x < 10 for x in result["losses"])
    # exported again with a tokenizer of another vocabulary (the corpus's 8,000 pieces for 256 rows):
    # a warning naming both sizes, not a silent directory whose tokenizer's ids index past the embedding
    with pytest.warns(UserWarning, match="has 8000 tokens but the model .* has a vocabulary of 256"):
        _export(str(tmp_path / "imported"), str(tmp_path / "hf_wrong_tokenizer"))
