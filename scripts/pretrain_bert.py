"""Pretrain BERT (masked LM + sentence-order or next-sentence prediction) with the megazero engine.

Same flags, console lines, TensorBoard scalars, checkpoints and resume as scripts/pretrain_gpt.py
(the loop is megazero/training.py's: --recompute-granularity, --recompute-num-layers and
--sequence-parallel included), plus --binary-head sop|nsp and --pre-layer-norm. Data: a sentence-level
indexed dataset, P_train_text_sentence / P_valid_text_sentence and P_tokenizer.model with the
[CLS] [SEP] [MASK] [PAD] pieces (`make data-bert`). Validation reports the masked-LM loss and the
sentence-head accuracy.
"""

from __future__ import annotations

import math
import os

from megazero import training
from megazero.data.bert_dataset import BertDataset
from megazero.profiling import gpt_flops_per_token
from models.bert import Bert, BertConfig
from models.common import count_parameters
from models.parallelize import parallelize

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
SPECIAL_PIECES = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")


def parse_args(argv=None):
    """The shared recipe flags (defaults: the CPU BERT configs) and BERT's own two."""
    p = training.recipe_parser(__doc__, model_config=os.path.join(CONFIGS, "bert_cpu.json"),
                               engine_config_path=os.path.join(CONFIGS, "ds_bert_cpu.json"))
    p.add_argument("--binary-head", choices=["sop", "nsp"], default=None, help="default: the model config's")
    p.add_argument("--pre-layer-norm", action="store_true", help="pre-LN blocks instead of BERT's post-LN")
    return p.parse_args(argv)


def model_config(args, vocab_size: int) -> BertConfig:
    """--model-config with the size, recompute and parallelism flags applied."""
    return BertConfig.from_json(args.model_config, vocab_size=vocab_size, binary_head=args.binary_head,
                                post_layer_norm=False if args.pre_layer_norm else None,
                                **training.model_overrides(args))


def bert_metrics(engine, dataset: BertDataset, args) -> dict[str, float]:
    """Masked-LM loss and sentence accuracy over the first --eval-iters micro-batches per rank
    (with pipelining only the total loss, which every stage receives)."""
    def measure(batch: dict) -> dict:
        if engine.is_pipelined:
            return {"loss": engine.eval_batch(batch)}
        out = engine.module.losses(**engine.to_device(batch))
        return {"loss": out["mlm"] + out["sop"], "mlm": out["mlm"], "sop_correct": out["sop_correct"]}

    result = training.evaluate(engine, dataset, args.eval_iters, measure)
    if "sop_correct" in result:  # a mean count per micro-batch: divide by its samples
        result["sentence_accuracy"] = result.pop("sop_correct") / engine.train_micro_batch_size_per_gpu()
    return result


def validation_metrics(engine, valid: dict[str, BertDataset], weights: dict[str, float],
                       args) -> tuple[dict[str, dict], dict]:
    """bert_metrics of each validation dataset, and their mean weighted by `weights`."""
    results = {name: bert_metrics(engine, data, args) for name, data in valid.items()}
    first = next(iter(results.values()))
    mean = {k: sum(weights[n] * r[k] for n, r in results.items()) for k in first} if len(results) > 1 else first
    return results, mean


def run_validation(engine, valid: dict[str, BertDataset], weights: dict[str, float], args, rank: int) -> float:
    """Evaluate each validation dataset, print and log (with several: each one's as
    `lm loss validation/<name>`, then their weighted mean as `lm loss validation`); returns the
    validation loss."""
    results, result = validation_metrics(engine, valid, weights, args)
    it = engine.global_steps
    if len(results) > 1:
        for name, one in results.items():
            engine.monitor.write(it, {f"lm loss validation/{name}": one["loss"]})
            if rank == 0:
                print(f" validation at iteration {it} | {name} | lm loss: {one['loss']:.4f}", flush=True)
    if rank == 0:
        extra = ""
        if "mlm" in result:
            extra = (f" | mlm loss: {result['mlm']:.4f} | mlm PPL: {math.exp(result['mlm']):.1f} | "
                     f"{engine.module.config.binary_head} accuracy: {result['sentence_accuracy']:.3f}")
        print(f" validation at iteration {it} | lm loss: {result['loss']:.4f}{extra}", flush=True)
    # Megatron's names, as the GPT recipe logs them: `lm loss validation` (here the masked-LM plus
    # the sentence-head loss, the console's lm loss), `mlm loss validation` (and its ppl) and the
    # sentence head's `sop/nsp accuracy validation`
    scalars = {"lm loss validation": result["loss"]}
    if "mlm" in result:
        scalars.update({"mlm loss validation": result["mlm"], "mlm loss validation ppl": math.exp(result["mlm"]),
                        f"{engine.module.config.binary_head} accuracy validation": result["sentence_accuracy"]})
    engine.monitor.write(it, scalars)
    engine.monitor.flush()
    return result["loss"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, grid, tokenizer = training.start_run(args)

    # the model: this rank's part of --model-config with the flags applied
    config = model_config(args, tokenizer.vocab_size)
    model = parallelize(config, grid, args.num_layers_per_virtual_pipeline_stage, training.partition_method(args),
                        num_microbatches=training.microbatches_per_step(args))
    args.seq_length = config.seq_length
    num_params = count_parameters(Bert, config.single_process())  # the same at every layout
    flops = gpt_flops_per_token(num_params, config.num_layers, config.hidden_size, config.seq_length)

    # the data: sentence pairs with masked tokens, from --data-path's P_train/P_valid_text_sentence
    # (or weights and prefixes to blend, or one dataset cut by --split)
    special = {piece: tokenizer.token_id(piece) for piece in SPECIAL_PIECES}

    def make(indexed, split: str) -> BertDataset:
        return BertDataset(indexed, config.seq_length, special, tokenizer.vocab_size, seed=args.seed,
                           binary_head=config.binary_head, shuffle=split == "train")

    data = training.build_datasets(args, make, kind="sentence")
    train_data = data.train

    def finish(engine, val_loss: float | None, reason: str | None) -> dict:
        """A final evaluation of every validation dataset, weighted (not after a preemption signal)."""
        final = validation_metrics(engine, data.valid, data.valid_weights, args)[1] if reason != "signal" else {}
        if rank == 0 and final:
            print("final validation: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()), flush=True)
        return {"iteration": engine.global_steps, **final}

    return training.train(args, model, train_data, grid=grid, name="BERT", num_params=num_params,
                          flops_per_token=flops, finish=finish,
                          validate=lambda engine: run_validation(engine, data.valid, data.valid_weights, args, rank),
                          details=lambda peak: f"{len(train_data):,} training samples, {config.binary_head} head")


if __name__ == "__main__":
    main()
