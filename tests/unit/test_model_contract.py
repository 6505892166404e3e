"""The model contract (megazero.model_contract), `parallelize` (models/parallelize.py), and the
checkpoint format version: the models answer the contract and a plain module gets the answers of
a model in one piece; parallelize builds what the model classes would, refuses a config that
does not fit the grid; a model file of an unknown format version is refused naming the file; the
library imports nothing from models/, scripts/, benchmarks/ or tests/."""

from __future__ import annotations

import ast
import os

import pytest
import torch

from megazero.checkpoint.files import FORMAT_VERSION, model_files_in
from megazero.checkpoint.io import CheckpointError, load_file, save_file
from megazero.checkpoint.model_files import load_model, write_weights_checkpoint
from megazero.model_contract import (
    ModelContract,
    global_name_of,
    implements_contract,
    tied_parameters,
    total_parameters,
)
from megazero.parallel_state import ParallelGrid
from models.bert import Bert, BertConfig
from models.common import count_parameters
from models.gpt import GPT, GPTConfig
from models.parallelize import build_stage, parallelize, stage_layers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT_SMALL = dict(vocab_size=96, seq_length=8, num_layers=4, hidden_size=16, num_attention_heads=2,
                 make_vocab_size_divisible_by=32)
BERT_SMALL = dict(vocab_size=96, seq_length=8, num_layers=4, hidden_size=16, num_attention_heads=2,
                  make_vocab_size_divisible_by=32)
CONFIGS = [(GPT, GPTConfig(**GPT_SMALL)), (Bert, BertConfig(**BERT_SMALL))]


def _grid(tp: int, pp: int, pp_rank: int) -> ParallelGrid:
    """A one-process grid's coordinates (no process groups: only sizes and ranks are read)."""
    return ParallelGrid(tp, pp, 1, 0, pp_rank, 0, None, None, None, None, None, list(range(pp)))


@pytest.mark.parametrize("model_class, config", CONFIGS)
def test_models_answer_the_contract(model_class, config):
    model = model_class(config)
    assert isinstance(model, ModelContract) and implements_contract(model)
    assert tied_parameters(model) == []  # one process: the output layer is the embedding itself
    assert total_parameters(model) == sum(p.numel() for p in model.parameters()) == count_parameters(model_class,
                                                                                                     config)


@pytest.mark.parametrize("model_class, config", CONFIGS)
def test_stages_name_their_parameters_globally_and_tie_the_embedding(model_class, config):
    whole = {name: p.shape for name, p in model_class(config).named_parameters()}
    seen = {}
    stages = [build_stage(config, s, 2) for s in range(2)]
    for stage in stages:
        rename = global_name_of(stage)
        seen.update({rename(name): p.shape for name, p in stage.named_parameters()})
        assert [id(p) for p in tied_parameters(stage)] == [id(stage.wte.weight)]
    assert seen == whole
    assert all(total_parameters(s) == sum(torch.Size(shape).numel() for shape in whole.values()) for s in stages)
    assert [s.layers for s in stages] == stage_layers(config, 2)


def test_model_chunks_name_their_parameters_globally_and_tie_the_embedding():
    """Interleaving, PP=2 x v=2 over 4 layers: stage 0 holds virtual stages 0 and 2 (layers 0, 2),
    stage 1 virtual stages 1 and 3 (layers 1, 3, the head); each chunk starts as the whole model."""
    from models.parallelize import build_chunks

    config = GPTConfig(vocab_size=64, seq_length=8, num_layers=4, hidden_size=16, num_attention_heads=2,
                       make_vocab_size_divisible_by=8)
    torch.manual_seed(0)
    whole = dict(GPT(config).named_parameters())
    seen = {}
    for stage in range(2):
        torch.manual_seed(0)
        chunks = build_chunks(config, stage, 2, 2)
        assert [c.layers for c in chunks.chunks] == [range(stage, stage + 1), range(stage + 2, stage + 3)]
        rename = global_name_of(chunks)
        seen.update({rename(name): p for name, p in chunks.named_parameters()})
        tied = chunks.chunks[0].wte.weight if stage == 0 else chunks.chunks[1].wte.weight
        assert [id(p) for p in tied_parameters(chunks)] == [id(tied)]
        assert total_parameters(chunks) == total_parameters(GPT(config))
    assert seen.keys() == whole.keys()
    assert all(torch.equal(seen[name], p) for name, p in whole.items())
    with pytest.raises(ValueError, match="num_layers 4 is not divisible by pipeline_model_parallel_size 2 x "
                                         "num_layers_per_virtual_pipeline_stage 3"):
        parallelize(config, _grid(1, 2, 0), 3)


def test_a_plain_module_is_a_model_in_one_piece():
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert not implements_contract(module)
    assert global_name_of(module)("0.weight") == "0.weight"
    assert tied_parameters(module) == []
    assert total_parameters(module) == 3 * 4 + 4 + 4 * 2 + 2


@pytest.mark.parametrize("model_class, config", CONFIGS)
def test_parallelize_without_a_grid_is_the_whole_model(model_class, config):
    torch.manual_seed(3)
    built = parallelize(config)
    torch.manual_seed(3)
    plain = model_class(config)
    assert type(built) is model_class
    assert built.state_dict().keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(built.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_parallelize_builds_this_ranks_stage():
    config = GPTConfig(**GPT_SMALL)
    for pp_rank in range(2):
        torch.manual_seed(5)
        stage = parallelize(config, _grid(1, 2, pp_rank))
        torch.manual_seed(5)
        expected = build_stage(config, pp_rank, 2)
        assert (stage.layers, stage.pre_process, stage.post_process) == (expected.layers, pp_rank == 0, pp_rank == 1)
        for name, value in expected.state_dict().items():
            torch.testing.assert_close(stage.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_parallelize_refuses_a_config_that_does_not_fit_the_grid():
    with pytest.raises(ValueError, match="GPTConfig.tensor_model_parallel_size is 1 but the grid's tensor-parallel "
                                         "size is 2"):
        parallelize(GPTConfig(**GPT_SMALL), _grid(2, 1, 0))
    with pytest.raises(TypeError, match="no model for a dict"):
        parallelize({"num_layers": 2})


def test_an_unknown_format_version_is_refused_naming_the_file(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_SMALL))
    save = str(tmp_path / "ckpt")
    write_weights_checkpoint(model.config, {n: p.detach() for n, p in model.named_parameters()}, save,
                             model_class=GPT)
    (path,) = model_files_in(os.path.join(save, "global_step0"))
    state = load_file(path)
    assert state["format_version"] == FORMAT_VERSION
    loaded = load_model(save, model_class=GPT, config_class=GPTConfig)
    for name, p in model.named_parameters():
        torch.testing.assert_close(dict(loaded.named_parameters())[name], p, rtol=0, atol=0, msg=name)
    save_file({**state, "format_version": FORMAT_VERSION + 1}, path)
    with pytest.raises(CheckpointError, match=f"{path}: format_version {FORMAT_VERSION + 1}, expected "
                                              f"{FORMAT_VERSION}"):
        load_model(save, model_class=GPT, config_class=GPTConfig)


def test_the_library_imports_no_models_scripts_or_tests():
    """megazero/ is the library: the recipes build on it, never the other way round."""
    offending = []
    for root, _, files in os.walk(os.path.join(REPO, "megazero")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                offending += [f"{os.path.relpath(path, REPO)}: {m}" for m in modules
                              if m.split(".")[0] in ("models", "scripts", "benchmarks", "tests")]
    assert offending == []
