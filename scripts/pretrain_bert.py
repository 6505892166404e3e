"""Pretrain BERT (masked LM + sentence-order or next-sentence prediction) with the megazero engine.

pretrain_gpt.py's run config and loop with BERT's model section (--binary-head sop|nsp,
--pre-layer-norm or --no-post-layer-norm) and validation. Data: a sentence-level indexed dataset,
P_train_text_sentence / P_valid_text_sentence and P_tokenizer.model with the [CLS] [SEP] [MASK]
[PAD] pieces (`make data-bert`). Validation reports the masked-LM loss and the sentence-head
accuracy.
"""

import math
import os

from pydantic import Field

from megazero import training
from megazero.config.cli import CONFIGS, model_config_of, model_section, parse_run
from megazero.config.run import RunConfig
from megazero.data.bert_dataset import BertDataset
from megazero.profiling import gpt_flops_per_token
from models.bert import Bert, BertConfig
from models.common import count_parameters
from models.parallelize import parallelize

RUN_FILE = os.path.join(CONFIGS, "run_bert_cpu.json")  # the recipe's settings; --config replaces it
SPECIAL_PIECES = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")


BertModel = model_section(BertConfig)


class BertRun(RunConfig):
    """The BERT recipe's run: the shared sections and BERT's model section."""

    model: BertModel = Field(default_factory=BertModel)


def bert_metrics(engine, dataset: BertDataset, eval_iters: int) -> dict[str, float]:
    """Masked-LM loss and sentence accuracy over the first --eval-iters micro-batches per rank
    (with pipelining only the total loss, which every stage receives)."""
    def measure(batch: dict) -> dict:
        if engine.is_pipelined:
            return {"loss": engine.eval_batch(batch)}
        out = engine.module.losses(**engine.to_device(batch))
        return {"loss": out["mlm"] + out["sop"], "mlm": out["mlm"], "sop_correct": out["sop_correct"]}

    result = training.evaluate(engine, dataset, eval_iters, measure)
    if "sop_correct" in result:  # a mean count per micro-batch: divide by its samples
        result["sentence_accuracy"] = result.pop("sop_correct") / engine.train_micro_batch_size_per_gpu()
    return result


def validation_metrics(engine, valid: dict[str, BertDataset], weights: dict[str, float],
                       eval_iters: int) -> tuple[dict[str, dict], dict]:
    """bert_metrics of each validation dataset, and their mean weighted by `weights`."""
    results = {name: bert_metrics(engine, data, eval_iters) for name, data in valid.items()}
    first = next(iter(results.values()))
    mean = {k: sum(weights[n] * r[k] for n, r in results.items()) for k in first} if len(results) > 1 else first
    return results, mean


def run_validation(engine, valid: dict[str, BertDataset], weights: dict[str, float], eval_iters: int,
                   rank: int) -> float:
    """Evaluate each validation dataset, print and log (with several: each one's as
    `lm loss validation/<name>`, then their weighted mean as `lm loss validation`); returns the
    validation loss."""
    results, result = validation_metrics(engine, valid, weights, eval_iters)
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


def main(argv: list[str] | None = None) -> dict:
    run = parse_run(BertRun, argv, RUN_FILE, __doc__)
    if run.data.document_packing(eod=0).enabled:
        raise SystemExit("[megazero] --reset-position-ids, --reset-attention-mask and --eod-mask-loss pack documents "
                         "into GPT/Llama samples; BERT's samples are sentence pairs of one document")
    rank, grid, tokenizer = training.start_run(run)

    # the model: this rank's part of it (tensor shard, pipeline stage), and its size for the logs
    config = model_config_of(run, BertConfig, tokenizer.vocab_size)
    pipeline = training.pipeline_options(run)
    model = parallelize(config, grid, **pipeline)
    num_params = count_parameters(Bert, config.single_process())  # the same at every layout
    flops = gpt_flops_per_token(num_params, config.num_layers, config.hidden_size, config.seq_length)

    # the data: sentence pairs with masked tokens, from --data-path's P_train/P_valid_text_sentence
    # (or weights and prefixes to blend, or one dataset cut by --split), and the engine
    special = {piece: tokenizer.token_id(piece) for piece in SPECIAL_PIECES}

    def make(indexed, split: str) -> BertDataset:
        return BertDataset(indexed, config.seq_length, special, tokenizer.vocab_size, seed=run.seed,
                           binary_head=config.binary_head, shuffle=split == "train")

    data = training.build_datasets(run, make, kind="sentence")
    engine, loader = training.build_engine(run, model, data.train)
    training.resume(engine, run.checkpoint, rank, run.schedule.train_iters)
    peak = training.peak_flops(engine, run, model)
    if rank == 0:
        print(training.header(engine, grid, "BERT", num_params,
                              f"{len(data.train):,} training samples, {config.binary_head} head"), flush=True)
    training.publish_run_config(run, engine, rank)
    split = training.pipeline_split(model, grid, pipeline["partition_method"], engine.config.pipeline.p2p_transport,
                                   engine.config.pipeline.schedule)
    if rank == 0 and split:
        print(split, flush=True)

    # the loop: a step, its log line, validation, a checkpoint, the stop checks
    schedule, save = run.schedule, run.checkpoint.save
    rampup = training.batch_rampup(run, engine)
    log = training.ProgressLog(engine, schedule, config.seq_length, flops, peak, rank, show_batch=rampup is not None)
    stop = training.RunStop(schedule.exit_duration_in_mins)
    batches = iter(loader)
    reason = None
    try:
        while engine.global_steps < schedule.train_iters:
            if rampup is not None:
                engine.set_train_batch_size(rampup.batch_size(engine.global_samples))
            loss = engine.train_batch(batches)
            log.record(loss.item())
            it, reason = engine.global_steps, stop.reason()
            last = it == schedule.train_iters or reason is not None
            with log.paused():  # iteration time excludes evaluation and saving
                # a run stopped by its time budget still ends validated; a signal leaves no time for it
                if reason != "signal" and (it % schedule.eval_interval == 0 or last):
                    run_validation(engine, data.valid, data.valid_weights, schedule.eval_iters, rank)
                if save and (it % schedule.save_interval == 0 or last):
                    training.save_or_stop(engine, run, it, rank, last=last)
            if reason:
                stop.announce(reason, it, rank)
                break
        # a final evaluation of every validation dataset, weighted (not after a preemption signal)
        final = validation_metrics(engine, data.valid, data.valid_weights, schedule.eval_iters)[1] \
            if reason != "signal" else {}
        if rank == 0 and final:
            print("final validation: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()), flush=True)
        training.finish_run(engine)
    finally:
        stop.close()
    return {"iteration": engine.global_steps, **final}


if __name__ == "__main__":
    main()
