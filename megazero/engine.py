"""The training engine (DeepSpeed's shape): forward, backward, step, checkpoints.

It composes the parts that do the work: the data-parallel state (`megazero.zero`: gradient
buckets, their reduction, the fp32 master weights, replicated or partitioned by ZeRO stage), the
loss scaler, the optimizer and LR schedule, the checkpoint writer and the monitor.

One optimizer step, at the gradient-accumulation boundary: wait for the gradient buckets, take
the global gradient norm (inf/nan: skip the step), unscale and clip (inside torch's fused Adam
when possible), step the optimizer on the fp32 master weights, write them into the model
(all-gathering the partitions under ZeRO), advance the LR schedule and the loss scale.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist

from megazero.config import EngineConfig
from megazero.engine_api import DeepSpeedEngineAPI
from megazero.model_contract import tied_parameters
from megazero.moe.aux_loss import aux_loss_gradient_scale
from megazero.monitor import Monitor
from megazero.numerics import loss_guard, numerics_error
from megazero.optim.protocol import DataParallelAverager, step_with_grad_scale, takes_grad_scale, writes_copies
from megazero.parallel_state import ParallelGrid
from megazero.pipeline.runner import EngineCalls, PipelineRunner
from megazero.precision import LossScaler, cast_floating
from megazero.profiling.memory import ActivationMeter
from megazero.profiling.timers import Timers
from megazero.step_state import StepField, StepState
from megazero.tensor_parallel.random import MicroBatchStreams
from megazero.tensor_parallel.utils import is_tensor_parallel


class Engine(DeepSpeedEngineAPI, torch.nn.Module):
    """Wraps a model for data-parallel, mixed-precision training with gradient accumulation.

    With a model-parallel `grid`, the module is this rank's tensor-parallel shard of one pipeline
    stage; ZeRO partitions over the grid's data-parallel group, gradient norms cover the whole
    model (shards summed, replicated parameters counted once), and train_batch() runs the 1F1B
    pipeline schedule over gradient_accumulation_steps micro-batches (megazero.pipeline.runner).
    The step's counters and flags live in `self.steps` (megazero.step_state.StepState).
    """

    # DeepSpeed's public counters, kept in self.steps
    micro_steps = StepField("micro_steps")
    global_steps = StepField("global_steps")
    global_samples = StepField("global_samples")
    skipped_steps = StepField("skipped_steps")
    nan_steps = StepField("nan_steps")
    consecutive_skipped_steps = StepField("consecutive_skipped")
    last_grad_norm = StepField("last_grad_norm")
    last_step_overflowed = StepField("last_step_overflowed")

    def __init__(self, model: torch.nn.Module, config: EngineConfig, optimizer: torch.optim.Optimizer,
                 dp_state, lr_scheduler, dp_group: dist.ProcessGroup | None, training_dataloader=None,
                 grid: ParallelGrid | None = None):
        super().__init__()
        self.module = model
        self.grid = grid
        # both pipeline copies of a tied word embedding (first and last stage): their gradients are summed
        self.tied_params = tied_parameters(model)
        self._tied_ids = {id(p) for p in self.tied_params}
        self.config = config
        self.optimizer = optimizer
        self.dp = dp_state
        self.lr_scheduler = lr_scheduler
        self.dp_group = dp_group
        self.dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        self.dp_world_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        # the batch is split sample_shards ways: DP without CP (context-parallel ranks share samples)
        self.sample_shard = grid.sample_shard if grid is not None else self.dp_rank
        self.sample_shards = grid.sample_shards if grid is not None else self.dp_world_size
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.training_dataloader = training_dataloader
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self.monitor = Monitor(config.tensorboard, config.wandb, rank=self.global_rank)
        self.timers = Timers(enabled=config.wall_clock_breakdown)
        self.steps = StepState()  # counters and flags of the step (megazero.step_state)
        self._loss_guards: list[torch.Tensor] = []  # per backward since the last step: 1.0, or nan for a bad loss
        self._numerics_error = None  # raised by step() once the step's counters are updated
        self.last_flops_profile: str | None = None
        self.last_activation_bytes = 0  # what the last forward kept for backward
        # dropout streams keyed by (step, micro-batch, stage, TP rank); the seed is saved in checkpoints
        self.rng_streams = MicroBatchStreams(config.seed if config.seed is not None else torch.initial_seed() % 2**31,
                                             grid.pp_rank if grid else 0, grid.tp_rank if grid else 0,
                                             grid.tensor_model_parallel_size if grid else 1,
                                             layout_invariant=config.dropout_masks.layout_invariant,
                                             cp_rank=grid.cp_rank if grid else 0,
                                             cp_size=grid.context_parallel_size if grid else 1)
        self.pipeline = PipelineRunner(grid, model, config, self.timers, self.steps, EngineCalls(
            self, self._backward, self._scaled_loss, self.step, lambda: self.device)) if self.is_pipelined else None
        # what the optimizer can do in its own pass (megazero.optim.protocol): unscale/clip (torch's
        # fused Adam, megazero's ops) and write the 16-bit model copy while updating each master
        self._optimizer_unscales = takes_grad_scale(optimizer)
        # an optimizer that averages over the data-parallel group itself (1-bit Adam once compressing)
        self._averager = optimizer if isinstance(optimizer, DataParallelAverager) else None
        self._optimizer_writes_copies = False
        targets = dp_state.copy_targets() if writes_copies(optimizer) else {}
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        if targets and all(id(p) in targets for p in masters):  # all or nothing: update_model skips the cast
            optimizer.set_copy_targets(targets)
            self._optimizer_writes_copies = True

    # ---- DeepSpeed's getters -------------------------------------------------------------
    def train_batch_size(self) -> int:
        """Samples per optimizer step, over all data-parallel ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward/backward on one rank."""
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.config.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        """Current learning rate of each param group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_loss_scale(self) -> float:
        """The loss scale the next backward uses (1.0 unless fp16)."""
        return self.loss_scaler.scale

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step's step() will update the weights (unless overridden by
        set_gradient_accumulation_boundary)."""
        return self.steps.is_boundary(self.gradient_accumulation_steps())

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: the global batch of the steps that follow, through the gradient accumulation
        steps (the micro-batch and data-parallel sizes stay); between optimizer steps only. A batch
        ramp-up (Megatron's --rampup-batch-size) calls it before each step. A schedule counting samples
        (MegatronLR's samples_per_step) follows it."""
        per_micro_step = self.train_micro_batch_size_per_gpu() * self.sample_shards
        if train_batch_size < per_micro_step or train_batch_size % per_micro_step:
            raise ValueError(f"train_batch_size {train_batch_size} is not a multiple of micro-batch "
                             f"{self.train_micro_batch_size_per_gpu()} x data-parallel size {self.sample_shards}")
        if self.steps.into_step(self.gradient_accumulation_steps()):
            raise RuntimeError("set_train_batch_size inside an optimizer step (after a micro-step's step() that did "
                               "not update the weights): call it between steps")
        if train_batch_size == self.train_batch_size():
            return
        self.config = self.config.model_copy(update={"train_batch_size": train_batch_size,
                                                     "gradient_accumulation_steps": train_batch_size // per_micro_step})
        self.steps.restart_window()
        if hasattr(self.lr_scheduler, "samples_per_step"):
            self.lr_scheduler.samples_per_step = train_batch_size

    # ---- the training step -------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """Run the wrapped model (profiling its FLOPs on the configured step)."""
        profile = self.config.flops_profiler
        profiling = (profile.enabled and self.global_steps + 1 == profile.profile_step
                     and self.steps.into_step(self.gradient_accumulation_steps()) == 0)
        if profiling:
            from megazero.profiling.flops_profiler import FlopsProfiler

            profiler = FlopsProfiler(self.module)
            profiler.start_profile()
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            inputs = cast_floating(inputs, torch.float16)
        self.timers("forward").start()
        with self._random_streams(), ActivationMeter() as meter:
            out = self.module(*inputs, **kwargs)
        self.last_activation_bytes = meter.bytes
        self.timers("forward").stop()
        if profiling:
            profiler.stop_profile()
            self.last_flops_profile = profiler.print_model_profile(
                profile.module_depth, profile.top_modules, profile.detailed,
                profile.output_file if self.global_rank == 0 else None)
            if self.global_rank == 0 and profile.output_file is None:
                print(self.last_flops_profile, flush=True)
        return out

    def _random_streams(self):
        """Training forwards draw dropout from this micro-batch's keyed streams (so that a resumed
        run draws what an uninterrupted one does); evaluation leaves the generators alone.

        Micro-batch `micro` of this DP rank (its forwards since the last step, or the pipeline
        schedule's micro-batch) is number micro x DP + rank of the step, and holds the global
        batch's samples from that number x micro-batch size on (DistributedBatchLoader's order):
        the layout-invariant dropout mode keys its masks by them."""
        if not self.module.training:
            return contextlib.nullcontext()
        micro = self.steps.next_forward()
        index, size = micro * self.sample_shards + self.sample_shard, self.train_micro_batch_size_per_gpu()
        return self.rng_streams.micro_batch(self.global_steps, index, range(index * size, (index + 1) * size))

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of loss * loss_scale / accumulation_steps; reduces gradients on the boundary."""
        self._backward(self._scaled_loss(loss, self.gradient_accumulation_steps()))
        return loss

    def _scaled_loss(self, loss: torch.Tensor, accumulation: int) -> torch.Tensor:
        """loss * loss_scale / accumulation in fp32, checked before backward: a non-finite loss poisons
        every gradient (megazero.numerics.loss_guard), so the step's global overflow test skips it on
        every rank and it counts toward max_consecutive_skipped_steps, as DeepSpeed's fp16 treats a
        nan loss. The check stays on the device (no host sync per micro-batch): 3 scalar kernels."""
        guard = loss_guard(loss)
        self._loss_guards.append(guard)
        return loss.float() * (self.loss_scaler.scale / accumulation) * guard

    def _backward(self, output: torch.Tensor, output_grad: torch.Tensor | None = None,
                  communicate: bool = True) -> None:
        """Backward of `output` (with `output_grad` where it is not a loss); communicate False: its
        gradients are reduced with the window's at the optimizer step (a zero-bubble pipeline
        schedule, whose weight gradients arrive after their backward)."""
        defer = not communicate
        reduces = not defer and self._reduces_this_backward(self.is_gradient_accumulation_boundary())
        if self._averager is not None:  # asked per window: it turns true when compression starts
            self.dp.local_gradients = self._averager.local_gradients
        self.dp.begin_micro_step(reduces, defer)
        self.timers("backward").start()
        # MoE auxiliary losses attached to activations get the gradient the loss gets (megazero/moe/aux_loss.py)
        with aux_loss_gradient_scale(self.loss_scaler.scale / self.gradient_accumulation_steps()):
            torch.autograd.backward(output, output_grad)
        self.dp.after_backward(reduces, defer)
        self.timers("backward").stop()

    def step(self) -> None:
        """End a micro-step; on the accumulation boundary, update the weights."""
        self._begin_step()
        if self.is_gradient_accumulation_boundary():
            self.timers("step").start()
            self._optimizer_step()
            self.timers("step").stop()
            self.steps.end_micro_step(True, self.train_batch_size())
            if self.global_steps % self.config.steps_per_print == 0:
                self._report_progress()
        else:
            self.steps.end_micro_step(False, 0)
        if self._numerics_error is not None:  # after the counters: the engine stays consistent
            error, self._numerics_error = self._numerics_error, None
            raise error

    def _optimizer_step(self) -> None:
        self.timers("backward_reduce").start()
        self.dp.reduce_gradients()
        if self.tied_params:
            self.dp.sync_grads(self.tied_params, self.grid.embedding_group)
        self.timers("backward_reduce").stop()
        scale = self.loss_scaler.scale
        grad_norm = self.dp.grad_norm(*self._norm_scope()) / scale
        overflow = not math.isfinite(grad_norm)
        self.steps.record_optimizer_step(grad_norm, overflow, nan=overflow and not self.loss_scaler.dynamic)
        if overflow:
            self._report_skipped_step(grad_norm)
            self.dp.start_window()
            self.loss_scaler.update(True)
            return
        self._loss_guards.clear()
        divisor = scale
        clip = self.config.gradient_clipping
        if clip > 0 and grad_norm > clip:
            divisor = scale * (grad_norm + 1e-6) / clip
        self.timers("optimizer").start()
        self.dp.attach_grads()
        if divisor != 1.0 and self._optimizer_unscales:  # inside its own pass: no extra pass over the grads
            step_with_grad_scale(self.optimizer, divisor)
        else:
            if divisor != 1.0:
                self.dp.scale_gradients(1.0 / divisor)
            self.optimizer.step()
        self.dp.detach_grads()
        self.dp.update_model(copies_written=self._optimizer_writes_copies)
        self.timers("optimizer").stop()
        self.dp.start_window()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.loss_scaler.update(False)

    def _norm_scope(self):
        """(counted, group) for the gradient norm: which parameters count on this rank (replicated
        ones on TP rank 0 only, the tied embedding on the first stage only) and the model-parallel
        group over which the partial sums are added (None without model parallelism)."""
        grid = self.grid
        if grid is None or grid.tensor_model_parallel_size * grid.pipeline_model_parallel_size == 1:
            return None, None

        def counted(p: torch.nn.Parameter) -> bool:
            if id(p) in self._tied_ids and not grid.is_first_stage:
                return False
            return grid.tp_rank == 0 or is_tensor_parallel(p)

        return counted, grid.model_parallel_group

    @property
    def is_pipelined(self) -> bool:
        """True when the model is split into pipeline stages."""
        return self.grid is not None and self.grid.pipeline_model_parallel_size > 1

    def train_batch(self, data_iter) -> torch.Tensor:
        """One optimizer step: gradient_accumulation_steps micro-batches from `data_iter`.

        Each batch is a mapping passed as keyword arguments to the model, which returns the loss.
        Returns the mean loss over the micro-batches (this data-parallel rank; with pipelining the
        last stage's, on every stage).
        """
        if self.is_pipelined:
            return self.pipeline.train_batch([self.to_device(next(data_iter))
                                              for _ in range(self.gradient_accumulation_steps())])
        total = None
        for _ in range(self.gradient_accumulation_steps()):
            batch = self.to_device(next(data_iter))
            loss = self(**batch) if isinstance(batch, dict) else self(*batch)
            self.backward(loss)
            self.step()
            value = loss.detach().float().double()  # summed where it is: no host sync per micro-batch
            total = value if total is None else total + value
        return (total / self.gradient_accumulation_steps()).float().cpu()

    @torch.no_grad()
    def eval_batch(self, batch) -> torch.Tensor:
        """Loss of one batch (a mapping of model keyword arguments), without gradients; with
        pipelining the batch runs through every stage, by the training schedule run forward only,
        and each rank returns the last stage's loss."""
        batch = self.to_device(batch)
        if not self.is_pipelined:
            return self(**batch).detach().float()
        return self.pipeline.eval_batch(batch)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live."""
        return next(self.module.parameters()).device

    def to_device(self, batch):
        """Move a batch (tensor, or dict/list/tuple of tensors) to the model's device."""
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict):
            return {key: self.to_device(value) for key, value in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(value) for value in batch)
        return batch

    def _report_skipped_step(self, grad_norm: float) -> None:
        """Report a step skipped with no dynamic loss scale to blame; at max_consecutive_skipped_steps
        build the NumericsError step() raises (collectively, while the gradients are still there to
        name the first non-finite one)."""
        if not self.loss_scaler.dynamic and self.global_rank == 0:
            print(f"[megazero] step {self.global_steps + 1} skipped: the gradient norm is {grad_norm} under "
                  f"{str(self.config.compute_dtype).replace('torch.', '')} without dynamic loss scaling "
                  f"({self.nan_steps} such steps so far)", flush=True)
        losses, self._loss_guards = self._loss_guards, []
        limit = self.config.max_consecutive_skipped_steps
        if limit and self.steps.consecutive_skipped >= limit:
            self._numerics_error = numerics_error(self, grad_norm, losses)

    def _report_progress(self) -> None:
        if self.global_rank == 0:
            lrs = ", ".join(f"{lr:.6g}" for lr in self.get_lr())
            print(f"[megazero] step={self.global_steps} skipped={self.skipped_steps} nan={self.nan_steps} "
                  f"lr=[{lrs}] loss_scale={self.loss_scaler.scale:g}", flush=True)
        if self.timers.enabled:
            names = ["forward", "backward", "backward_reduce", "step", "optimizer"]
            self.timers.log(names + (["pipe_send_recv"] if self.is_pipelined else []), group=None,
                            rank=self.global_rank)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states (and its RSS)."""
        from megazero.profiling.memory import engine_memory_report

        return engine_memory_report(self)

    # ---- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag=None, client_state: dict | None = None) -> str:
        """Write a checkpoint atomically under save_dir/str(tag) (default 'global_step{N}'; rank 0's tag on
        every rank, see the config's checkpoint.tag_validation); update 'latest'."""
        from megazero.checkpoint.engine_state import save_engine_checkpoint

        return save_engine_checkpoint(self, save_dir, tag, client_state or {})

    def load_checkpoint(self, load_dir: str | os.PathLike, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, fallback: bool = False):
        """Load load_dir/str(tag) (default: the tag named by 'latest'); returns (path, client_state).

        DeepSpeed's arguments, in its order: load_module_strict (module keys must match),
        load_module_only (weights and buffers only: optimizer, schedule, counters and RNG stay as they
        are). Returns (None, None) when there is no checkpoint to load. fallback: when `latest` is
        corrupt (garbage, or names a missing or incomplete tag), load the previous complete tag with a
        warning instead of raising.
        """
        from megazero.checkpoint.engine_state import load_engine_checkpoint

        return load_engine_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                      load_module_strict, load_module_only, fallback)
