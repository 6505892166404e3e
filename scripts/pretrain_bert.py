"""Pretrain BERT (masked LM + sentence-order or next-sentence prediction) with the megazero engine.

Same flags, console lines, TensorBoard scalars, checkpoints and resume as scripts/pretrain_gpt.py
(whose pieces it uses: --recompute-granularity, --recompute-num-layers and --sequence-parallel
included), plus --binary-head sop|nsp and --pre-layer-norm. Data: a sentence-level
indexed dataset, P_train_text_sentence / P_valid_text_sentence and P_tokenizer.model with the
[CLS] [SEP] [MASK] [PAD] pieces (`make data-bert`). Validation reports the masked-LM loss and the
sentence-head accuracy.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import pretrain_gpt  # noqa: E402

import megazero  # noqa: E402
from megazero import parallel_state  # noqa: E402
from megazero.data import DistributedBatchLoader, IndexedDataset  # noqa: E402
from megazero.data.bert_dataset import BertDataset  # noqa: E402
from megazero.distributed import all_reduce_values  # noqa: E402
from megazero.profiling import gpt_flops_per_token, measure_peak_flops  # noqa: E402
from models.bert import Bert, BertConfig  # noqa: E402
from models.common import count_parameters  # noqa: E402
from models.parallelize import parallelize as build_model  # noqa: E402

SPECIAL_PIECES = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")


def parse_args(argv=None):
    p = pretrain_gpt.recipe_parser(__doc__, "bert_cpu.json", "ds_bert_cpu.json")
    p.add_argument("--binary-head", choices=["sop", "nsp"], default=None, help="default: the model config's")
    p.add_argument("--pre-layer-norm", action="store_true", help="pre-LN blocks instead of BERT's post-LN")
    args = p.parse_args(argv)
    if args.tokenizer_model is None:
        args.tokenizer_model = args.data_path + "_tokenizer.model"
    return args


@torch.no_grad()
def evaluate(engine, dataset: BertDataset, args) -> dict[str, float]:
    """Masked-LM loss and sentence accuracy over the first --eval-iters micro-batches per rank
    (with pipelining only the total loss, which every stage receives)."""
    engine.eval()
    micro = engine.train_micro_batch_size_per_gpu()
    samples = min(len(dataset), args.eval_iters * micro * engine.dp_world_size)
    loader = DistributedBatchLoader(dataset, micro, engine.dp_rank, engine.dp_world_size, num_samples=samples)
    mlm = correct = total = seen = 0.0
    for batch in loader:
        if engine.is_pipelined:
            total += engine.eval_batch(batch).item()
        else:
            out = engine.module.losses(**engine.to_device(batch))
            mlm += out["mlm"].item()
            total += (out["mlm"] + out["sop"]).item()
            correct += out["sop_correct"].item()
        seen += 1
    mlm, correct, total, seen = all_reduce_values([mlm, correct, total, seen], group=engine.dp_group)
    engine.train()
    result = {"loss": total / seen}
    if not engine.is_pipelined:
        result.update(mlm=mlm / seen, sentence_accuracy=correct / (seen * micro))
    return result


def run_validation(engine, valid: BertDataset, args, rank: int) -> float:
    """Evaluate, print and log; returns the validation loss."""
    result = evaluate(engine, valid, args)
    it = engine.global_steps
    if rank == 0:
        extra = ""
        if "mlm" in result:
            extra = (f" | mlm loss: {result['mlm']:.4f} | mlm PPL: {math.exp(result['mlm']):.1f} | "
                     f"{engine.module.config.binary_head} accuracy: {result['sentence_accuracy']:.3f}")
        print(f" validation at iteration {it} | lm loss: {result['loss']:.4f}{extra}", flush=True)
    engine.monitor.write(it, {f"validation/{k}": v for k, v in result.items()})
    engine.monitor.flush()
    return result["loss"]


def model_config(args, vocab_size: int) -> BertConfig:
    """--model-config with the size, recompute and parallelism flags applied."""
    return BertConfig.from_json(args.model_config, vocab_size=vocab_size, num_layers=args.num_layers,
                                  hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                                  seq_length=args.seq_length, dropout=args.dropout, binary_head=args.binary_head,
                                  post_layer_norm=False if args.pre_layer_norm else None,
                                  recompute_granularity=args.recompute_granularity,
                                  recompute_num_layers=args.recompute_num_layers,
                                  tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  sequence_parallel=args.sequence_parallel or None)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, grid, tokenizer = pretrain_gpt.start_run(args)
    special = {piece: tokenizer.token_id(piece) for piece in SPECIAL_PIECES}
    config = model_config(args, tokenizer.vocab_size)
    model = build_model(config, grid)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    datasets = {split: BertDataset(IndexedDataset(f"{args.data_path}_{split}_text_sentence"), config.seq_length,
                                   special, tokenizer.vocab_size, seed=args.seed, binary_head=config.binary_head,
                                   shuffle=split == "train") for split in ("train", "valid")}
    engine, _, loader, _ = megazero.initialize(
        args=args, model=model, model_parameters=pretrain_gpt.param_groups(model), training_data=datasets["train"],
        config=pretrain_gpt.engine_config(args), mpu=parallel_state)
    if args.load:
        path, _ = engine.load_checkpoint(args.load)
        if path and rank == 0:
            print(f"resumed from {path} at iteration {engine.global_steps}", flush=True)
    peak = args.peak_flops or measure_peak_flops(engine.config.compute_dtype, seconds=0.3,
                                                 device=next(model.parameters()).device)
    num_params = count_parameters(Bert, config)
    flops = gpt_flops_per_token(num_params, config.num_layers, config.hidden_size, config.seq_length)
    args.seq_length = config.seq_length
    if rank == 0:
        print(f"BERT: {num_params:,} parameters, {dist.get_world_size()} ranks = TP {grid.tensor_model_parallel_size}"
              f" x PP {grid.pipeline_model_parallel_size} x DP {grid.data_parallel_size}, batch "
              f"{engine.train_batch_size()} = {engine.train_micro_batch_size_per_gpu()} x "
              f"{engine.gradient_accumulation_steps()} x {engine.dp_world_size}, {engine.config.compute_dtype}, "
              f"{len(datasets['train']):,} training samples, {config.binary_head} head", flush=True)
    stop = pretrain_gpt.StopSignal()
    log = pretrain_gpt.ProgressLog(engine, args, flops, peak, rank)
    val_loss, reason = pretrain_gpt.train_loop(engine, loader, args, log, stop, rank,
                                               lambda: run_validation(engine, datasets["valid"], args, rank))
    final = evaluate(engine, datasets["valid"], args) if reason != "signal" else {}
    if rank == 0 and final:
        print(f"final validation: {final}", flush=True)
    engine.monitor.close()
    dist.barrier()
    dist.destroy_process_group()
    return {"iteration": engine.global_steps, **final}


if __name__ == "__main__":
    main()
