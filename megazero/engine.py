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
from megazero.model_contract import HIDDEN_STATES, tied_parameters
from megazero.moe.aux_loss import aux_loss_gradient_scale
from megazero.moe.layer import attached_aux_loss
from megazero.monitor import Monitor
from megazero.numerics import loss_guard, numerics_error
from megazero.optim.protocol import DataParallelAverager, GradScaleTaker, takes_grad_scale, writes_copies
from megazero.parallel_state import ParallelGrid
from megazero.precision import LossScaler, cast_floating
from megazero.profiling.memory import ActivationMeter
from megazero.profiling.timers import Timers
from megazero.tensor_parallel.random import MicroBatchStreams
from megazero.tensor_parallel.utils import is_tensor_parallel


class Engine(DeepSpeedEngineAPI, torch.nn.Module):
    """Wraps a model for data-parallel, mixed-precision training with gradient accumulation.

    With a model-parallel `grid`, the module is this rank's tensor-parallel shard of one pipeline
    stage; ZeRO partitions over the grid's data-parallel group, gradient norms cover the whole
    model (shards summed, replicated parameters counted once), and train_batch() runs the 1F1B
    pipeline schedule over gradient_accumulation_steps micro-batches.
    """

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
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.training_dataloader = training_dataloader
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self.monitor = Monitor(config.tensorboard, config.wandb, rank=self.global_rank)
        self.timers = Timers(enabled=config.wall_clock_breakdown)
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._accumulation_origin = 0  # micro_steps when the accumulation steps last changed (set_train_batch_size)
        self.skipped_steps = 0
        # skipped steps whose gradients were inf/nan with no dynamic loss scale to blame (fp32, bf16,
        # static fp16): a diverging run, not a loss-scale search; reported, never skipped silently
        self.nan_steps = 0
        # skipped steps in a row (any cause), toward config.max_consecutive_skipped_steps (not saved in
        # checkpoints: a resumed run counts afresh); megazero.numerics says what stops the run
        self.consecutive_skipped_steps = 0
        self._loss_guards: list[torch.Tensor] = []  # per backward since the last step: 1.0, or nan for a bad loss
        self._numerics_error = None  # raised by step() once the step's counters are updated
        self.last_grad_norm: float | None = None
        self.last_step_overflowed = False
        self.last_flops_profile: str | None = None
        self.last_activation_bytes = 0  # what the last forward kept for backward
        # dropout streams keyed by (step, micro-batch, stage, TP rank); the seed is saved in checkpoints
        self.rng_streams = MicroBatchStreams(config.seed if config.seed is not None else torch.initial_seed() % 2**31,
                                             grid.pp_rank if grid else 0, grid.tp_rank if grid else 0,
                                             grid.tensor_model_parallel_size if grid else 1,
                                             layout_invariant=config.dropout_masks.layout_invariant)
        self._pipeline_micro: int | None = None  # the 1F1B schedule's micro-batch in forward
        self._pipeline_shapes: dict = {}  # the p2p messages' shapes, kept across steps (StageLinks' shapes)
        # training forwards since the last optimizer step: the micro-batch's number within its step,
        # also when the user accumulates with no_sync() or set_gradient_accumulation_boundary()
        self._forwards_since_step = 0
        # what the optimizer can do in its own pass (megazero.optim.protocol): unscale/clip (torch's
        # fused Adam, megazero's ops) and write the 16-bit model copy while updating each master
        self._optimizer_unscales = takes_grad_scale(optimizer)
        # decided once: the engine sets grad_scale on torch's fused Adam too, which would then look
        # like a GradScaleTaker
        self._grad_scale_as_float = isinstance(optimizer, GradScaleTaker)
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
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps - self._accumulation_origin + 1) % self.gradient_accumulation_steps() == 0

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: the global batch of the steps that follow, through the gradient accumulation
        steps (the micro-batch and data-parallel sizes stay); between optimizer steps only. A batch
        ramp-up (Megatron's --rampup-batch-size) calls it before each step. A schedule counting samples
        (MegatronLR's samples_per_step) follows it."""
        per_micro_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size < per_micro_step or train_batch_size % per_micro_step:
            raise ValueError(f"train_batch_size {train_batch_size} is not a multiple of micro-batch "
                             f"{self.train_micro_batch_size_per_gpu()} x data-parallel size {self.dp_world_size}")
        if (self.micro_steps - self._accumulation_origin) % self.gradient_accumulation_steps():
            raise RuntimeError("set_train_batch_size inside an optimizer step (after a micro-step's step() that did "
                               "not update the weights): call it between steps")
        if train_batch_size == self.train_batch_size():
            return
        self.config = self.config.model_copy(update={"train_batch_size": train_batch_size,
                                                     "gradient_accumulation_steps": train_batch_size // per_micro_step})
        self._accumulation_origin = self.micro_steps
        if hasattr(self.lr_scheduler, "samples_per_step"):
            self.lr_scheduler.samples_per_step = train_batch_size

    # ---- the training step -------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """Run the wrapped model (profiling its FLOPs on the configured step)."""
        profile = self.config.flops_profiler
        profiling = (profile.enabled and self.global_steps + 1 == profile.profile_step
                     and (self.micro_steps - self._accumulation_origin) % self.gradient_accumulation_steps() == 0)
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
        if self._pipeline_micro is not None:
            micro = self._pipeline_micro
        else:
            micro = self._forwards_since_step
            self._forwards_since_step += 1
        index, size = micro * self.dp_world_size + self.dp_rank, self.train_micro_batch_size_per_gpu()
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

    def _backward(self, output: torch.Tensor, output_grad: torch.Tensor | None = None) -> None:
        reduces = self._reduces_this_backward(self.is_gradient_accumulation_boundary())
        if self._averager is not None:  # asked per window: it turns true when compression starts
            self.dp.local_gradients = self._averager.local_gradients
        self.dp.begin_micro_step(reduces)
        self.timers("backward").start()
        # MoE auxiliary losses attached to activations get the gradient the loss gets (megazero/moe/aux_loss.py)
        with aux_loss_gradient_scale(self.loss_scaler.scale / self.gradient_accumulation_steps()):
            torch.autograd.backward(output, output_grad)
        self.dp.after_backward(reduces)
        self.timers("backward").stop()

    def step(self) -> None:
        """End a micro-step; on the accumulation boundary, update the weights."""
        self._begin_step()
        if self.is_gradient_accumulation_boundary():
            self.timers("step").start()
            self._optimizer_step()
            self.timers("step").stop()
            self._step_applied = not self.last_step_overflowed
            self._forwards_since_step = 0
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            if self.global_steps % self.config.steps_per_print == 0:
                self._report_progress()
        self.micro_steps += 1
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
        self.last_step_overflowed = overflow
        self.last_grad_norm = grad_norm
        if overflow:
            self.skipped_steps += 1
            if not self.loss_scaler.dynamic:
                self._report_nan_step(grad_norm)
            self._count_skipped_step(grad_norm)
            self.dp.start_window()
            self.loss_scaler.update(True)
            return
        self.consecutive_skipped_steps = 0
        self._loss_guards.clear()
        divisor = scale
        clip = self.config.gradient_clipping
        if clip > 0 and grad_norm > clip:
            divisor = scale * (grad_norm + 1e-6) / clip
        self.timers("optimizer").start()
        self.dp.attach_grads()
        if divisor != 1.0 and self._optimizer_unscales:
            # the optimizer divides by grad_scale inside its own pass: no extra pass over the grads.
            # megazero's ops take a float (fp32-rounded, as torch's fused Adam's tensor is): a tensor
            # on the GPU would be read back, a host sync; torch's fused Adam wants a tensor on the
            # device, made by a fill kernel (no host-to-device copy to wait for)
            if self._grad_scale_as_float:
                self.optimizer.grad_scale = torch.tensor(divisor, dtype=torch.float32).item()
            else:
                self.optimizer.grad_scale = torch.full((), divisor, dtype=torch.float32, device=self.device)
        elif divisor != 1.0:
            self.dp.scale_gradients(1.0 / divisor)
        self.optimizer.step()
        if self._optimizer_unscales:
            self.optimizer.grad_scale = None
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
            return self._train_batch_pipelined(data_iter)
        total = None
        for _ in range(self.gradient_accumulation_steps()):
            batch = self.to_device(next(data_iter))
            loss = self(**batch) if isinstance(batch, dict) else self(*batch)
            self.backward(loss)
            self.step()
            value = loss.detach().float().double()  # summed where it is: no host sync per micro-batch
            total = value if total is None else total + value
        return (total / self.gradient_accumulation_steps()).float().cpu()

    def _train_batch_pipelined(self, data_iter) -> torch.Tensor:
        """train_batch() through the 1F1B schedule (interleaved when the module holds several model
        chunks, megazero.pipeline.ModelChunks): every stage reads the same micro-batches; the first
        virtual stage feeds the inputs, later ones take hidden_states from their predecessor."""
        grid, micro = self.grid, self.gradient_accumulation_steps()
        batches = [self.to_device(next(data_iter)) for _ in range(micro)]

        def backward_step(chunk: int, m: int, output: torch.Tensor, output_grad: torch.Tensor | None) -> None:
            if output_grad is None:  # the last virtual stage's output is the loss
                output = self._scaled_loss(output, micro)
            self._backward(output, output_grad)
            # one micro-step per micro-batch, ended by its last backward here (chunk 0's); the
            # boundary backward, the stage's last, is chunk 0's of the last micro-batch
            if chunk == 0 and m < micro - 1:
                self.step()

        aux: list[torch.Tensor] = []
        losses = self._run_pipeline_schedule(batches, backward_step, aux)
        self.step()  # the optimizer step, once this stage has sent its last input gradient
        mean = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32, device=self.device)
        if aux:  # MoE auxiliary losses of the model chunks without the loss, as the single model's loss has them
            mean = mean + torch.stack(aux).sum() / micro
        dist.all_reduce(mean, group=grid.pp_group)  # the last stage's loss (plus those), the same on every stage
        return mean.cpu()

    def _run_pipeline_schedule(self, batches: list, backward_step, aux: list | None = None) -> list[torch.Tensor]:
        """Run `batches` through this stage's 1F1B schedule (interleaved with several model chunks);
        backward_step None: forward only (evaluation). Returns the last stage's losses (fp32); `aux`
        gets the value of the MoE auxiliary losses each training forward of a chunk without the
        loss attached to its output (megazero.moe.attached_aux_loss)."""
        from megazero.pipeline import StageLinks, interleaved_one_f_one_b, one_f_one_b
        from megazero.pipeline.chunks import MODEL_CHUNK, model_chunks
        from megazero.pipeline.p2p import input_shapes

        grid = self.grid
        chunks = model_chunks(self.module)
        num_chunks = len(chunks)
        # messages of shapes both sides have seen for these input shapes go without their headers
        links = StageLinks(grid.pp_ranks, grid.pp_rank, grid.pp_group, self.config.compute_dtype, self.device,
                           self.timers, ring=num_chunks > 1, shapes=self._pipeline_shapes,
                           shape_key=input_shapes(batches), transport=self.config.pipeline.p2p_transport)
        losses = []

        auto_cast = self.config.fp16.enabled and self.config.fp16.auto_cast  # the stages' inputs, as forward's

        def forward_step(chunk: int, m: int, received: torch.Tensor | None) -> torch.Tensor:
            batch = cast_floating(batches[m], torch.float16) if auto_cast else batches[m]
            kwargs = dict(batch) if received is None else {**batch, HIDDEN_STATES: received}
            if num_chunks > 1:
                kwargs[MODEL_CHUNK] = chunk
            self._pipeline_micro = m
            try:
                output = self(**kwargs)
            finally:
                self._pipeline_micro = None
            if grid.is_last_stage and chunk == num_chunks - 1:
                losses.append(output.detach().float())
            elif aux is not None and torch.is_tensor(value := attached_aux_loss(chunks[chunk])):
                aux.append(value.float())
            return output

        stage, stages, micro = grid.pp_rank, grid.pipeline_model_parallel_size, len(batches)
        forward_only = backward_step is None
        if num_chunks > 1:
            interleaved_one_f_one_b(micro, stage, stages, num_chunks, links, forward_step, backward_step,
                                    forward_only)
        else:
            one_f_one_b(micro, stage, stages, links, lambda m, x: forward_step(0, m, x),
                        None if forward_only else lambda m, y, g: backward_step(0, m, y, g), forward_only)
        return losses

    @torch.no_grad()
    def eval_batch(self, batch) -> torch.Tensor:
        """Loss of one batch (a mapping of model keyword arguments), without gradients; with
        pipelining the batch runs through every stage, by the training schedule run forward only,
        and each rank returns the last stage's loss."""
        batch = self.to_device(batch)
        if not self.is_pipelined:
            return self(**batch).detach().float()
        losses = self._run_pipeline_schedule([batch], None)
        loss = losses[0] if losses else torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(loss, src=self.grid.pp_ranks[-1], group=self.grid.pp_group)
        return loss

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

    def _report_nan_step(self, grad_norm: float) -> None:
        self.nan_steps += 1
        if self.global_rank == 0:
            print(f"[megazero] step {self.global_steps + 1} skipped: the gradient norm is {grad_norm} under "
                  f"{str(self.config.compute_dtype).replace('torch.', '')} without dynamic loss scaling "
                  f"({self.nan_steps} such steps so far)", flush=True)

    def _count_skipped_step(self, grad_norm: float) -> None:
        """Count a skipped step; at max_consecutive_skipped_steps build the NumericsError step() raises
        (collectively, while the gradients are still there to name the first non-finite one)."""
        self.consecutive_skipped_steps += 1
        losses, self._loss_guards = self._loss_guards, []
        limit = self.config.max_consecutive_skipped_steps
        if limit and self.consecutive_skipped_steps >= limit:
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
