"""Generation from a pipelined model (megazero.pipeline.pipelined_generate) equals the single
process's: token for token when greedy (through the KV cache and past seq_length, where the window
slides and is recomputed), and sampled with the same seed where the layout computes the same logits
bit for bit (pure pipelining: TP's all-reduces sum in another order, so there only greedy is
compared). Layouts on 4 gloo ranks: PP=2 x DP=2, TP=2 x PP=2, PP=2 with 2 model chunks per stage
(interleaved, and in zbv's V: both in strict p2p), and a Llama at PP=2. Dropout is on in the models' configs: generation
runs them in eval mode.

The same pool runs scripts/generate.py pipelined (a checkpoint loaded at TP=2 x PP=2 and at PP=2;
rank 0 alone prints), the recipe's end-of-run sample at PP=2 (training.print_sample: the text a
PP=1 run prints), and the engine config's pipeline.num_layers_per_virtual_stage (the model
initialize() gets must have its chunks; the recipe flag and the key must agree)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os

import torch
import torch.distributed as dist

from tests.conftest import CORPUS_PREFIX, REPO

TOKENIZER = CORPUS_PREFIX + "_tokenizer.model"
PROMPT = [[5, 17, 42, 7, 99]]
GREEDY_TOKENS = 14  # 5 + 14 > seq_length 16: the last steps slide the window


def _gpt_config(**changes):
    from models.gpt import GPTConfig

    base = dict(vocab_size=256, seq_length=16, num_layers=4, hidden_size=32, num_attention_heads=4, dropout=0.1)
    return GPTConfig(**{**base, **changes})


def _reference(model_class, config) -> tuple[list, list]:
    """(greedy, sampled) continuations of PROMPT by the whole model in this process."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    prompt = torch.tensor(PROMPT)
    greedy = model.generate(prompt, GREEDY_TOKENS, temperature=0)
    torch.manual_seed(7)
    sampled = model.generate(prompt, 8, temperature=0.8, top_k=40, top_p=0.9)
    return greedy.tolist(), sampled.tolist()


def _layouts_generate_as_one_process() -> dict:
    from megazero import parallel_state
    from megazero.pipeline import pipelined_generate
    from megazero.pipeline.p2p import set_strict
    from models.gpt import GPT
    from models.llama import Llama, LlamaConfig
    from models.parallelize import parallelize

    prompt = torch.tensor(PROMPT)
    seen = {}
    cases = [("gpt pp2", GPT, _gpt_config(), 1, None, True), ("gpt tp2 pp2", GPT, _gpt_config(), 2, None, False),
             ("gpt pp2 v2", GPT, _gpt_config(), 1, 1, True), ("gpt pp2 zbv", GPT, _gpt_config(), 1, "zbv", True),
             ("llama pp2", Llama, LlamaConfig(vocab_size=256, seq_length=16, num_layers=2, hidden_size=32,
                                              num_attention_heads=4, num_query_groups=2, dropout=0.1,
                                              fused_kernels=False), 1, None, True)]
    for name, model_class, config, tp, layers_per_chunk, exact in cases:
        greedy, sampled = _reference(model_class, config)
        grid = parallel_state.initialize_model_parallel(tp, 2)
        torch.manual_seed(0)  # the stage's shard of the model the reference built
        schedule = "zbv" if layers_per_chunk == "zbv" else "1f1b"  # zbv: two chunks in a V, rank 0 both ends
        module = parallelize(dataclasses.replace(config, tensor_model_parallel_size=tp), grid,
                             None if schedule == "zbv" else layers_per_chunk, pipeline_schedule=schedule).eval()
        set_strict(layers_per_chunk is not None)  # the sends wait for their receives: NCCL's order
        try:
            out = pipelined_generate(module, grid, prompt, GREEDY_TOKENS, temperature=0).tolist()
            assert out == greedy, f"{name}: greedy {out} != one process's {greedy}"
            if name == "gpt pp2":  # without the cache: every step recomputes the window
                plain = pipelined_generate(module, grid, prompt, GREEDY_TOKENS, temperature=0, use_kv_cache=False)
                assert plain.tolist() == greedy, f"{name} without the KV cache: {plain.tolist()} != {greedy}"
            if exact:
                torch.manual_seed(7)
                drawn = pipelined_generate(module, grid, prompt, 8, temperature=0.8, top_k=40, top_p=0.9).tolist()
                assert drawn == sampled, f"{name}: sampled {drawn} != one process's {sampled}"
        finally:
            set_strict(None)
        seen[name] = out
    return seen


def test_pipelined_generation_equals_one_process(pools):
    results = pools(4).run(_layouts_generate_as_one_process)
    assert all(r == results[0] for r in results)  # every rank ends with the whole text
    assert len(results[0]["gpt pp2"][0]) == len(PROMPT[0]) + GREEDY_TOKENS


def _sample_model():
    """(config, the whole GPT in eval mode): the corpus tokenizer's vocabulary."""
    from models.gpt import GPT

    config = _gpt_config(vocab_size=8000, seq_length=32)
    torch.manual_seed(0)
    return config, GPT(config).eval()


def _generate_script_and_recipe_sample(save_dir: str) -> dict:
    from megazero import parallel_state, training
    from megazero.data import SentencePieceTokenizer
    from models.parallelize import parallelize
    from scripts.generate import main as generate

    config, whole = _sample_model()  # the model of the checkpoint in save_dir
    common = ["--load", save_dir, "--tag", "global_step0", "--tokenizer-model", TOKENIZER, "--prompt", "ROMEO:",
              "--max-new-tokens", "8"]
    out = {}
    for name, options in (("greedy", ["--temperature", "0"]), ("sampled", ["--top-k", "40", "--seed", "3"])):
        with contextlib.redirect_stdout(io.StringIO()):
            single = generate(common + options)  # the plain path: this process alone
        for layout in (["--pipeline-model-parallel-size", "2"],
                       ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]):
            if name == "sampled" and "--tensor-model-parallel-size" in layout:
                continue  # TP sums in another order: only greedy is token-exact there
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                text = generate(common + options + layout)
            assert text == single, f"{name} at {layout}: {text!r} != one process's {single!r}"
            assert printed.getvalue() == (single + "\n" if dist.get_rank() == 0 else ""), printed.getvalue()
        out[name] = single

    # the recipe's end-of-run sample inside a PP=2 run: the text a PP=1 run prints
    tokenizer = SentencePieceTokenizer(TOKENIZER)
    args = argparse.Namespace(sample_prompt="ROMEO:\n", sample_tokens=6, seed=5)
    expected = training.sample_text(whole, tokenizer, args.sample_prompt, args.sample_tokens, args.seed)
    grid = parallel_state.initialize_model_parallel(1, 2)
    torch.manual_seed(0)
    stage = parallelize(config, grid)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        training.print_sample(stage, tokenizer, args, args.seed, grid, dist.get_rank())
    assert printed.getvalue() == ("----- sample -----\n" + expected + "\n------------------\n"
                                  if dist.get_rank() == 0 else ""), printed.getvalue()
    assert stage.training  # back in training mode for the rest of the run
    out["sample"] = expected
    return out


def test_generate_script_and_recipe_sample_pipelined(pools, corpus_prefix, tmp_path):
    from megazero.checkpoint.model_files import write_weights_checkpoint
    from models.gpt import GPT

    config, whole = _sample_model()
    write_weights_checkpoint(config, whole.state_dict(), str(tmp_path / "ckpt"), model_class=GPT)  # TP = PP = 1
    results = pools(4).run(_generate_script_and_recipe_sample, str(tmp_path / "ckpt"))
    assert results[0]["greedy"].startswith("ROMEO:") and results[0]["sample"].startswith("ROMEO:")


def _engine_config(layers_per_chunk: int | None) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if layers_per_chunk is not None:
        config["pipeline"] = {"num_layers_per_virtual_stage": layers_per_chunk}
    return config


def _virtual_stage_key() -> list[str]:
    import megazero
    from megazero import parallel_state
    from megazero.config import ConfigError, virtual_stage_layers
    from models.parallelize import parallelize

    config = _gpt_config(vocab_size=64)  # 4 layers
    grid = parallel_state.initialize_model_parallel(1, 2)
    errors = []
    # a user picks v in the engine config alone: the model is built with what the key says
    source = _engine_config(1)
    engine, *_ = megazero.initialize(model=parallelize(config, grid, virtual_stage_layers(source)), config=source,
                                     mpu=parallel_state)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(engine.eval_batch({"input_ids": ids, "labels": ids}))  # the interleaved schedule
    for model_layers, key in ((None, 1), (1, 3)):  # a plain stage where the key says 2 chunks; 4 layers / (2 x 3)
        try:
            megazero.initialize(model=parallelize(config, grid, model_layers), config=_engine_config(key),
                                mpu=parallel_state)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def test_virtual_stage_key_picks_the_chunks_and_checks_the_model(pools):
    errors = pools(4).run(_virtual_stage_key)[0]
    assert len(errors) == 2, errors
    assert "'pipeline.num_layers_per_virtual_stage'=1 means 2 model chunks per stage" in errors[0], errors
    assert "has 1" in errors[0] and "'pipeline.num_layers_per_virtual_stage'=3: num_layers 4 is not divisible" \
        in errors[1], errors


def test_virtual_stage_flag_over_the_key_and_the_printed_config_says_so(tmp_path, corpus_prefix):
    from megazero import training
    from megazero.config.cli import describe, parse_run
    from scripts.pretrain_gpt import RUN_FILE, GPTRun

    path = tmp_path / "ds.json"
    with open(os.path.join(REPO, "configs", "ds_gpt2_cpu.json")) as f:
        raw = json.load(f)
    path.write_text(json.dumps({**raw, "pipeline": {"num_layers_per_virtual_stage": 2}}))
    base = ["--data-path", corpus_prefix, "--deepspeed_config", str(path)]
    assert training.pipeline_options(parse_run(GPTRun, base, RUN_FILE))["num_layers_per_virtual_stage"] == 2
    flag = parse_run(GPTRun, base + ["--num-layers-per-virtual-pipeline-stage", "1"], RUN_FILE)
    assert training.pipeline_options(flag)["num_layers_per_virtual_stage"] == 1
    assert flag.engine["pipeline"] == {"num_layers_per_virtual_stage": 1}
    assert ("pipeline.num_layers_per_virtual_stage = 1 from --num-layers-per-virtual-pipeline-stage (the engine "
            "JSON's: 2)") in describe(flag)
    flag_only = parse_run(GPTRun, ["--data-path", corpus_prefix, "--num-layers-per-virtual-pipeline-stage", "3"],
                          RUN_FILE)
    assert training.pipeline_options(flag_only)["num_layers_per_virtual_stage"] == 3
