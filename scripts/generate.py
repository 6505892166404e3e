"""Generate text from a GPT or Llama checkpoint of any layout (joined into one process), greedy or sampled,
with a KV cache.

    python scripts/generate.py --load CKPT --prompt "ROMEO:" --max-new-tokens 100 \
        [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1234 --no-kv-cache]

--temperature 0 is greedy decoding; output with and without the KV cache is identical. Only the
model's vocab_size tokens are sampled, never the padding ids megazero adds for tensor parallelism.

Pipelined (and tensor-parallel) under torchrun: each rank loads its stage's shard of the checkpoint
(of any layout) and the stages generate together (megazero.pipeline.pipelined_generate); rank 0
prints. The output equals the single process's (greedy and, with the same --seed, sampled).

    torchrun --nproc_per_node 4 scripts/generate.py --load CKPT --pipeline-model-parallel-size 2 \
        --tensor-model-parallel-size 2 --temperature 0
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist

from megazero.checkpoint.consolidate import consolidate_fp32_state_dict
from megazero.checkpoint.model_files import load_model, saved_model_config_dict, saved_tokenizer_spec
from megazero.checkpoint.universal import local_shard
from megazero.data.tokenizer import CHECKPOINT_TOKENIZER, add_tokenizer_args, tokenizer_from_args
from megazero.model_contract import global_name_of
from models.parallelize import MODELS, build_stage, config_class_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER = os.path.join(REPO, "data", "gpt2", "shakespeare_tokenizer.model")


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (any TP/PP/DP layout, any ZeRO stage)")
    parser.add_argument("--tag", default=None)
    add_tokenizer_args(parser, DEFAULT_TOKENIZER, CHECKPOINT_TOKENIZER)
    parser.add_argument("--prompt", default="ROMEO:\n")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context at every step")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                        help="under torchrun: generate with the model split into this many pipeline stages")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="under torchrun: each stage split over this many tensor-parallel ranks")
    args = parser.parse_args(argv)
    spec, tokenizer = tokenizer_from_args(args, saved_tokenizer_spec(args.load, args.tag), args.load)
    saved = saved_model_config_dict(args.load, args.tag) or {}
    config_class = config_class_for(saved)  # GPT or Llama
    grid = None
    if args.pipeline_model_parallel_size * args.tensor_model_parallel_size > 1:
        grid, model = _load_stage(args, saved, config_class)
    else:
        model = load_model(args.load, args.tag, model_class=MODELS[config_class], config_class=config_class)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"the tokenizer {spec.describe()} has {tokenizer.vocab_size} tokens but the model in "
                         f"{args.load} was trained with vocab_size {model.config.vocab_size}")
    torch.manual_seed(args.seed)
    ids = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, use_kv_cache=not args.no_kv_cache)
    if grid is None:
        out = model.generate(ids, args.max_new_tokens, **options)
    else:
        from megazero.pipeline import pipelined_generate

        out = pipelined_generate(model, grid, ids, args.max_new_tokens, **options)
    text = tokenizer.decode(out[0].tolist())
    if grid is None or dist.get_rank() == 0:
        print(text)
    return text


def _load_stage(args: argparse.Namespace, saved: dict, config_class) -> tuple:
    """(grid, this rank's stage of the model at --pipeline/--tensor-model-parallel-size, in eval mode,
    its weights cut from the checkpoint's whole fp32 tensors, as an engine loading another layout
    cuts them: megazero.checkpoint.universal.local_shard)."""
    import megazero
    from megazero import parallel_state

    megazero.init_distributed()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    try:
        grid = parallel_state.initialize_model_parallel(tp, pp)
    except ValueError as e:
        raise SystemExit(f"[megazero] rank {dist.get_rank()}: --tensor-model-parallel-size {tp}, "
                         f"--pipeline-model-parallel-size {pp}: {e}") from None
    # the saved model at this layout; sequence parallelism off (the KV cache does not serve it)
    changes = {"tensor_model_parallel_size": tp}
    if "sequence_parallel" in config_class.__dataclass_fields__:
        changes["sequence_parallel"] = False
    config = dataclasses.replace(config_class(**saved), **changes)
    # built for real, not on the meta device: materialising a skeleton may swap the parameters for
    # new ones, without the tensor-parallel attributes that say how to cut them
    model = build_stage(config, grid.pp_rank, pp, grid.tp_group, grid.ep_group)
    whole = consolidate_fp32_state_dict(args.load, args.tag)
    rename, params = global_name_of(model), dict(model.named_parameters())
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        full = whole[rename(name)]
        state[name] = local_shard(full, params[name], tensor.shape, grid, rename(name), saved.get("vocab_size")) \
            if name in params else full
    model.load_state_dict(state, strict=True)
    return grid, model.eval()


if __name__ == "__main__":
    main()
