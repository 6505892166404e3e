"""The engine's pipelined train and eval batches: this stage's part of the pipeline schedule
(`pipeline.schedule`): 1F1B, interleaved when the module holds several model chunks in the loop
layout (megazero.pipeline.ModelChunks), zb-h1 (1F1B's order, split backwards), zbv (two chunks in
the V layout). A schedule with split backwards whose forwards and backwards are not 1F1B's (zbv, or
a new generator in megazero.pipeline.actions.SCHEDULES) runs as data on
megazero.pipeline.action_runner.

Every stage reads the same micro-batches; the first virtual stage feeds the inputs, later ones
take HIDDEN_STATES from their predecessor (megazero.model_contract). The runner knows the engine
only through the callables it is given: the forward, the backward of one output, the scaled loss
and the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.model_contract import HIDDEN_STATES
from megazero.moe.layer import attached_aux_loss
from megazero.pipeline.action_runner import Round, exchange_rounds, run_actions
from megazero.pipeline.actions import SCHEDULES, SPLIT_SCHEDULES, Schedule, check_schedule
from megazero.pipeline.actions import forward_only as forward_only_schedule
from megazero.pipeline.chunks import LOOP, MODEL_CHUNK, V, chunk_layout, chunk_place, chunk_stage, model_chunks
from megazero.pipeline.interleaved import interleaved_one_f_one_b
from megazero.pipeline.p2p import StageLinks, input_shapes
from megazero.pipeline.schedule import in_1f1b_order, one_f_one_b, run_in_1f1b_order
from megazero.precision import cast_floating
from megazero.step_state import StepState
from megazero.tensor_parallel.weight_grad import STORE, deferring, splittable


@dataclass
class EngineCalls:
    """What the runner asks of the engine."""

    forward: Callable[..., torch.Tensor]  # the engine's forward (dropout streams, FLOPs profile)
    # backward of an output (and its gradient); communicate False: no reduction started by it
    backward: Callable[..., None]
    scaled_loss: Callable[[torch.Tensor, int], torch.Tensor]  # the loss as backward takes it, per accumulation
    step: Callable[[], None]  # engine.step()
    device: Callable[[], torch.device]


class PipelineRunner:
    """Runs batches through this stage's schedule for the engine (one per engine)."""

    def __init__(self, grid, module: torch.nn.Module, config, timers, steps: StepState, calls: EngineCalls):
        self.grid = grid
        self.module = module
        self.config = config
        self.timers = timers
        self.steps = steps
        self.calls = calls
        self.shapes: dict | None = {}  # the p2p messages' shapes, kept across steps (None: no cache)
        self._schedules: dict[tuple[str, int], Schedule] = {}  # generated once per micro-batch count
        self._rounds: dict[tuple[str, int], list[Round]] = {}  # this rank's exchanges of a V schedule
        self.weight_jobs = 0  # deferred weight gradients computed by W actions (split schedules), all steps

    def train_batch(self, batches: list) -> torch.Tensor:
        """One optimizer step over `batches` (gradient_accumulation_steps micro-batches): the last
        stage's mean loss, the same on every stage."""
        micro = len(batches)

        split = self.split_schedule(micro) is not None

        def backward_step(chunk: int, m: int, output: torch.Tensor, output_grad: torch.Tensor | None) -> None:
            if output_grad is None:  # the last virtual stage's output is the loss
                output = self.calls.scaled_loss(output, micro)
            if split:  # the B: weight gradients deferred to the W, reduced at the step (all arrive by then)
                with splittable(), deferring((chunk, m)):
                    self.calls.backward(output, output_grad, communicate=False)
            else:
                self.calls.backward(output, output_grad)
            # one micro-step per micro-batch, ended by its last backward here (chunk 0's); the
            # boundary backward, the stage's last, is chunk 0's of the last micro-batch
            if chunk == 0 and m < micro - 1:
                self.calls.step()

        aux: list[torch.Tensor] = []
        STORE.clear()  # (weight gradients a failed step left pending)
        losses = self.run(batches, backward_step, aux)
        self.calls.step()  # the optimizer step, once this stage has sent its last input gradient
        mean = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32,
                                                                     device=self.calls.device())
        if aux:  # MoE auxiliary losses of the model chunks without the loss, as the single model's loss has them
            mean = mean + torch.stack(aux).sum() / micro
        dist.all_reduce(mean, group=self.grid.pp_group)  # the last stage's loss (plus those), the same on every stage
        return mean.cpu()

    def split_schedule(self, num_microbatches: int) -> Schedule | None:
        """The schedule with split backwards (`pipeline.schedule` zb-h1 or zbv) for this many
        micro-batches, or None (1F1B, interleaved)."""
        name = self.config.pipeline.schedule
        if name not in SPLIT_SCHEDULES:
            return None
        key = (name, num_microbatches)
        if key not in self._schedules:  # generated and checked once (an InvalidSchedule is a generator's bug)
            schedule = SCHEDULES[name](self.grid.pipeline_model_parallel_size, num_microbatches)
            check_schedule(schedule)
            self._schedules[key] = schedule
            if not in_1f1b_order(schedule):  # run by the action runner: its exchanges planned once
                self._rounds[key] = exchange_rounds(schedule)[self.grid.pp_rank]
        return self._schedules[key]

    def _weights(self, chunk: int, micro: int) -> None:
        """The W of micro-batch `micro` on model chunk `chunk`: the weight gradients its B deferred
        (timed as `backward_weight`, beside the B's `backward`)."""
        timer = self.timers("backward_weight")
        timer.start()
        try:
            self.weight_jobs += STORE.run((chunk, micro))
        finally:
            timer.stop()

    def loss_stage(self) -> int:
        """The pipeline stage computing the loss: the one holding the last virtual stage (the first
        stage in the V layout)."""
        chunks = len(model_chunks(self.module))
        p = self.grid.pipeline_model_parallel_size
        return chunk_place(p * chunks - 1, p, chunk_layout(self.module))[0]

    def eval_batch(self, batch) -> torch.Tensor:
        """The last stage's loss of one batch run forward through every stage, on every rank."""
        losses = self.run([batch], None)
        loss = losses[0] if losses else torch.zeros((), dtype=torch.float32, device=self.calls.device())
        dist.broadcast(loss, src=self.grid.pp_ranks[self.loss_stage()], group=self.grid.pp_group)
        return loss

    def run(self, batches: list, backward_step, aux: list | None = None) -> list[torch.Tensor]:
        """Run `batches` through this stage's 1F1B schedule (interleaved with several model chunks);
        backward_step None: forward only (evaluation). Returns the last stage's losses (fp32); `aux`
        gets the value of the MoE auxiliary losses each training forward of a chunk without the
        loss attached to its output (megazero.moe.attached_aux_loss)."""
        grid = self.grid
        chunks = model_chunks(self.module)
        num_chunks, layout = len(chunks), chunk_layout(self.module)
        last_virtual = grid.pipeline_model_parallel_size * num_chunks - 1
        split = None if backward_step is None else self.split_schedule(len(batches))
        # messages of shapes both sides have seen for these input shapes go without their headers
        links = StageLinks(grid.pp_ranks, grid.pp_rank, grid.pp_group, self.config.compute_dtype, self.calls.device(),
                           self.timers, ring=num_chunks > 1 and layout == LOOP, shapes=self.shapes,
                           shape_key=input_shapes(batches), transport=self.config.pipeline.p2p_transport)
        losses = []
        auto_cast = self.config.fp16.enabled and self.config.fp16.auto_cast  # the stages' inputs, as forward's

        def forward_step(chunk: int, m: int, received: torch.Tensor | None) -> torch.Tensor:
            batch = cast_floating(batches[m], torch.float16) if auto_cast else batches[m]
            kwargs = dict(batch) if received is None else {**batch, HIDDEN_STATES: received}
            if num_chunks > 1:
                kwargs[MODEL_CHUNK] = chunk
            self.steps.pipeline_micro = m
            try:
                with splittable(split is not None):
                    output = self.calls.forward(**kwargs)
            finally:
                self.steps.pipeline_micro = None
            if chunk_stage(chunk, grid.pp_rank, grid.pipeline_model_parallel_size, layout) == last_virtual:
                losses.append(output.detach().float())
            elif aux is not None and torch.is_tensor(value := attached_aux_loss(chunks[chunk])):
                aux.append(value.float())
            return output

        stage, stages, micro = grid.pp_rank, grid.pipeline_model_parallel_size, len(batches)
        forward_only = backward_step is None
        if layout == V or split is not None and not in_1f1b_order(split):  # any schedule, as data
            schedule = forward_only_schedule(stages, micro, num_chunks, layout) if forward_only else split
            rounds = None if forward_only else self._rounds[(self.config.pipeline.schedule, micro)]
            run_actions(schedule, stage, links, grid.pp_ranks, forward_step, backward_step, self._weights, rounds)
        elif split is not None:  # zb-h1: 1F1B's messages, its W's where 1F1B waits
            run_in_1f1b_order(split, stage, links, lambda m, x: forward_step(0, m, x),
                              lambda m, y, g: backward_step(0, m, y, g), lambda m: self._weights(0, m))
        elif num_chunks > 1:
            interleaved_one_f_one_b(micro, stage, stages, num_chunks, links, forward_step, backward_step,
                                    forward_only)
        else:
            one_f_one_b(micro, stage, stages, links, lambda m, x: forward_step(0, m, x),
                        None if forward_only else lambda m, y, g: backward_step(0, m, y, g), forward_only)
        return losses
