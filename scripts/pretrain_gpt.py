"""Pretrain a GPT with the megazero engine: Megatron-LM's flags, one run config, and the loop below.

Launch with torchrun (or srun/mpirun); a plain `python` run is world size 1. The run's settings are
one tree (megazero/config/run.py): configs/run_gpt2_cpu.json, or --config FILE, then the flags
(`--help` lists them all). Resumes from --load when it holds a checkpoint. See
scripts/pretrain_gpt2.sh for the `make pretrain-gpt2` recipe. Fork this file to change the loop.
"""

import os

from pydantic import Field

from megazero import training
from megazero.causal_lm_recipe import causal_lm_data, end_of_run
from megazero.config.cli import CONFIGS, model_config_of, model_section, parse_run
from megazero.config.run import RunConfig, SampleSection
from megazero.profiling import gpt_flops_per_token
from models.common import count_active_parameters, count_parameters
from models.gpt import GPT, GPTConfig
from models.parallelize import parallelize

RUN_FILE = os.path.join(CONFIGS, "run_gpt2_cpu.json")  # the recipe's settings; --config replaces it


GPTModel = model_section(GPTConfig)


class GPTRun(RunConfig):
    """The GPT recipe's run: the shared sections, GPT's model section and the end-of-run sample."""

    model: GPTModel = Field(default_factory=GPTModel)
    sample: SampleSection = SampleSection()


def main(argv: list[str] | None = None) -> dict:
    run = parse_run(GPTRun, argv, RUN_FILE, __doc__)
    rank, grid, tokenizer = training.start_run(run)

    # the model: this rank's part of it (tensor shard, pipeline stage), and its size for the logs
    config = model_config_of(run, GPTConfig, tokenizer.vocab_size)
    pipeline = training.pipeline_options(run)
    model = parallelize(config, grid, **pipeline)
    num_params = count_parameters(GPT, config.single_process())  # the same at every layout
    active = count_active_parameters(GPT, config.single_process())  # MoE: the experts a token visits
    flops = gpt_flops_per_token(active, config.num_layers, config.hidden_size, config.seq_length)

    # the data (--data-path: one prefix, or weights and prefixes to blend) and the engine
    data = causal_lm_data(run, tokenizer)
    engine, loader = training.build_engine(run, model, data.splits.train)
    training.resume(engine, run.checkpoint, rank, run.schedule.train_iters)
    peak = training.peak_flops(engine, run, model)
    if rank == 0:
        print(training.header(engine, grid, "GPT", num_params, f"peak {peak / 1e9:.1f} GFLOP/s per rank", active),
              flush=True)
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
    val_loss, reason = None, None
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
                    val_loss = data.validate(engine, schedule.eval_iters, rank)
                if save and (it % schedule.save_interval == 0 or last):
                    training.save_or_stop(engine, run, it, rank, last=last)
            if reason:
                stop.announce(reason, it, rank)
                break
        result = end_of_run(engine, model, data, run, tokenizer, grid, rank, val_loss, reason)
        training.finish_run(engine)
    finally:
        stop.close()
    return result


if __name__ == "__main__":
    main()
