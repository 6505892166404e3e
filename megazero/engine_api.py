"""DeepSpeed's engine methods beyond forward/backward/step, for loops and libraries written for
DeepSpeed (Hugging Face Trainer, Accelerate, Lightning). Each keeps DeepSpeed's name, arguments and
meaning and delegates to the engine's parts: the config, the data-parallel state, the checkpoint
code. The engine calls two hooks: `_reduces_this_backward` (no_sync and the boundary override) and
`_begin_step` (step() is refused inside no_sync; was_step_applied is reset).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch.distributed as dist


class DeepSpeedEngineAPI:
    """Mixin for megazero.engine.Engine (which provides config, dp, module, optimizer, grid,
    global_rank and steps, its megazero.step_state.StepState)."""

    # ---- configuration and topology -----------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3)."""
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        """True when the model computes in float16 (with loss scaling)."""
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """True when the model computes in bfloat16."""
        return self.config.bf16.enabled

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (the launcher's LOCAL_RANK / SLURM_LOCALID / MPI local rank)."""
        from megazero.distributed import detect_launch_env

        return detect_launch_env().local_rank

    @property
    def world_size(self) -> int:
        """Processes in the whole job (all of data, tensor and pipeline parallelism)."""
        return dist.get_world_size() if dist.is_initialized() else 1

    # ---- what the last step did ---------------------------------------------------------------
    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of the whole gradient (all ranks, all model-parallel shards), unscaled and before
        clipping, measured by the last optimizer step; inf/nan when that step was skipped for overflow;
        None before the first step."""
        return self.steps.last_grad_norm

    def was_step_applied(self) -> bool:
        """True when the latest step() updated the weights: False between accumulation boundaries,
        after an overflow skip, and before the first step."""
        return self.steps.step_applied

    def get_mom(self) -> list:
        """Per param group: `betas` for Adam-like optimizers, else `momentum` (SGD), else 0.0."""
        return [group.get("betas", group.get("momentum", 0.0)) for group in self.optimizer.param_groups]

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The wrapped module's state_dict (under ZeRO-3 its partitioned parameters are empty: use
        save_16bit_model or scripts/zero_to_fp32.py for whole weights)."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    # ---- gradient accumulation under the user's control ---------------------------------------
    def zero_grad(self) -> None:
        """Discard the gradients accumulated since the last step (waiting first for reductions a
        backward already started; collective in that case, as that backward was)."""
        if self.steps.reduced_at_micro_step == self.steps.micro_steps:
            self.dp.reduce_gradients()
        self.steps.reduced_at_micro_step = None
        self.dp.start_window()
        for param in self.module.parameters():
            param.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip gradient communication; gradients accumulate locally and the next
        backward outside reduces them all. step() is refused inside. ZeRO stages 2 and 3 reduce-scatter
        during every backward to partition the gradients, so there it raises (as in DeepSpeed)."""
        if self.dp.gradients_partitioned:
            raise RuntimeError(f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                               f"stage {self.zero_optimization_stage()}: use stage 0 or 1, or "
                               f"gradient_accumulation_steps")
        if self.steps.inside_no_sync:
            raise RuntimeError("no_sync context manager reentry is unsupported")
        self.steps.inside_no_sync = True
        try:
            yield
        finally:
            self.steps.inside_no_sync = False

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override whether the next backward/step are at the accumulation boundary (None: count micro-
        steps again). DeepSpeed's pattern: False before each of the first micro-batches' forward/backward,
        True before the last one's, then a single step()."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary expects a bool (or None), got "
                            f"{type(is_boundary).__name__} {is_boundary!r}")
        self.steps.boundary_override = is_boundary

    def _reduces_this_backward(self, boundary: bool) -> bool:
        """Hook for the engine's backward: whether its gradients are reduced now."""
        reduces = boundary and not self.steps.inside_no_sync
        if reduces:
            self.steps.reduced_at_micro_step = self.steps.micro_steps
        return reduces

    def _begin_step(self) -> None:
        """Hook at the top of the engine's step()."""
        if self.steps.inside_no_sync:
            raise RuntimeError("It is illegal to call Engine.step() inside no_sync context manager")
        self.steps.step_applied = False

    # ---- weights for inference / export -------------------------------------------------------
    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective: global rank 0 writes the module's state dict in the model's own dtype (bf16/fp16
        when training in 16-bit) to save_dir/save_filename, atomically; safetensors when the name ends in
        .safetensors. Under ZeRO-3 the weights are gathered only with zero_optimization.
        stage3_gather_16bit_weights_on_model_save; without it nothing is written and False is returned
        (DeepSpeed's behaviour). Returns True once the file is complete. exclude_frozen_parameters leaves
        out parameters with requires_grad False."""
        from megazero.checkpoint.engine_state import module_weights
        from megazero.checkpoint.io import save_tensors

        path = os.path.join(os.fspath(save_dir), save_filename)
        grid = self.grid
        if grid is not None and grid.tensor_model_parallel_size * grid.pipeline_model_parallel_size > 1:
            raise ValueError(f"save_16bit_model writes the module of one rank, but this model is split (tensor "
                             f"parallel {grid.tensor_model_parallel_size}, pipeline "
                             f"{grid.pipeline_model_parallel_size}): save a checkpoint and use "
                             f"scripts/export_hf.py or scripts/zero_to_fp32.py for one whole file")
        zero = self.config.zero_optimization
        if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
            if self.global_rank == 0:
                warnings.warn(f"did not save {path}: under ZeRO-3 the weights are partitioned; set "
                              f"zero_optimization.stage3_gather_16bit_weights_on_model_save to gather them",
                              stacklevel=2)
            return False
        weights = module_weights(self)
        if weights is not None:
            if exclude_frozen_parameters:
                for name, param in self.module.named_parameters():
                    if not param.requires_grad:
                        weights.pop(name, None)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save_tensors(weights, path)
        if dist.is_initialized():
            dist.barrier()
        return True
