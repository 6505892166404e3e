"""Muon (Keller Jordan 2024, "Muon: An optimizer for hidden layers in neural networks"): SGD
momentum whose update, for each weight matrix, is replaced by the nearest semi-orthogonal matrix,
computed by a quintic Newton-Schulz iteration; AdamW for everything that is not a hidden matrix.

Per step, for a hidden matrix W with gradient G and momentum M (zero at the start):
    M = beta * M + (1 - beta) * G
    U = (1 - beta) * G + beta * M           (nesterov; else U = M)
    O = NewtonSchulz5(U) * scale(rows, cols)
    W = W * (1 - lr * weight_decay) - lr * O
NewtonSchulz5 normalises U by its Frobenius norm and runs 5 steps of X <- aX + (bA + cA^2)X with
A = XX^T and (a, b, c) = (3.4445, -4.7750, 2.0315), in bfloat16, on the wide orientation. The scale
is max(1, rows / cols) ** 0.5 (`scale_mode: "shape"`, the reference's) or sqrt(max(rows, cols))
(`"spectral"`: with extra_scale_factor 0.2 Moonlight's scale, whose update RMS matches AdamW's so
one learning rate serves both). Everything else is stepped by AdamW (bias-corrected moments,
decoupled decay) with adamw_lr, adamw_betas, adamw_eps and adamw_weight_decay.

Which parameters are matrices for Muon (`muon_param_groups`): 2-D weights of layers other than
embeddings and the output layer, i.e. whose global name matches none of `adamw_params` (glob
patterns; the default names the embeddings and output layers of the models in models/), and the
MoE experts' weights (a [experts, rows, cols] stack: each expert's matrix on its own). A fused
weight (the tensor-parallel `partition_stride` > 1: GPT's [Q; K; V], Llama's [K; V] and [gate; up])
is orthogonalised per logical matrix, each of its stride blocks alone, as separate Q, K, V (and
gate, up) weights would be: the reference's models keep them separate.

The orthogonalisation needs the whole matrix. The optimizer computes U elementwise on whatever it
steps (a whole tensor, or a ZeRO partition's flat chunk) and hands every U to its `orthogonalizer`
(megazero.zero.whole_matrices binds one for each data-parallel state and tensor-parallel group):
the default orthogonalises each tensor as it is, right for whole parameters in one process.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

import torch
from pydantic import Field

from megazero.config_fields import Betas, Bool, Float, Int, Section, Str

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# embeddings and output layers of the models in models/ (GPT: wte, wpe; Llama: lm_head; BERT: its
# embeddings and heads; Megatron's names): AdamW, as in the reference
DEFAULT_ADAMW_PARAMS = ("*embed*", "*wte*", "*wpe*", "*lm_head*", "*output_layer*", "*cls*", "*pooler*")


class MuonParams(Section):
    """Muon on hidden matrices (momentum orthogonalised by Newton-Schulz), AdamW on the rest."""

    lr: Float = Field(0.02, ge=0, description="Muon's learning rate (the hidden matrices')")
    momentum: Float = Field(0.95, ge=0, lt=1, description="momentum decay beta")
    nesterov: Bool = Field(True, description="Nesterov momentum: U = (1 - beta) G + beta M (false: U = M)")
    ns_steps: Int = Field(5, ge=1, description="Newton-Schulz iterations")
    ns_dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="Newton-Schulz matmul dtype "
                                                                            "(the reference's bfloat16)")
    scale_mode: Literal["shape", "spectral"] = Field(
        "shape", description="update scale: shape max(1, rows/cols)**0.5 (the reference), spectral "
                             "sqrt(max(rows, cols)) (Moonlight's with extra_scale_factor 0.2)")
    extra_scale_factor: Float = Field(1.0, gt=0, description="multiplies the scale (Moonlight: 0.2)")
    weight_decay: Float = Field(0.0, ge=0, description="Muon's decoupled weight decay")
    adamw_lr: Float | None = Field(3e-4, ge=0, description="AdamW's learning rate for the other parameters "
                                                          "(null: lr, Moonlight's one learning rate)")
    adamw_betas: Betas = Field((0.9, 0.95), description="AdamW's moment decay rates")
    adamw_eps: Float = Field(1e-10, ge=0, description="AdamW's epsilon")
    adamw_weight_decay: Float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    adamw_params: list[Str] = Field(list(DEFAULT_ADAMW_PARAMS),
                                    description="glob patterns of parameter names stepped by AdamW even when 2-D")


def newton_schulz(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz iteration's approximate orthogonalisation of a 2-D matrix (the
    reference's zeropower_via_newtonschulz5), returned in fp32. The matmuls run in `dtype`, fused as
    two addmm per step."""
    a, b, c = NS_COEFFICIENTS
    tall = update.size(0) > update.size(1)
    x = update.t() if tall else update
    x = x.to(dtype)
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.t()
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    x = x.t() if tall else x
    return x.float()


def update_scale(rows: int, cols: int, mode: str, extra: float) -> float:
    """The factor the orthogonalised update of a rows x cols matrix is multiplied by."""
    base = max(1.0, rows / cols) ** 0.5 if mode == "shape" else math.sqrt(max(rows, cols))
    return base * extra


def orthogonalize(whole: torch.Tensor, group: dict, partition_dim: int | None = None, stride: int = 1) -> torch.Tensor:
    """Muon's scaled update of one whole weight (`group`: its Muon param group's options): each of
    its `stride` blocks along `partition_dim` (a fused weight's logical matrices) on its own; a 3-D
    stack of MoE experts' matrices expert by expert."""
    if whole.dim() == 3:
        inner = partition_dim - 1 if partition_dim is not None else None
        return torch.stack([orthogonalize(matrix, group, inner, stride) for matrix in whole])
    blocks = whole.chunk(stride, dim=partition_dim) if stride > 1 and partition_dim is not None else (whole,)
    dtype = torch.bfloat16 if group["ns_dtype"] == "bfloat16" else torch.float32
    out = [newton_schulz(block, group["ns_steps"], dtype)
           * update_scale(block.size(0), block.size(1), group["scale_mode"], group["extra_scale_factor"])
           for block in blocks]
    return torch.cat(out, dim=partition_dim) if len(out) > 1 else out[0]


# (master, U) pairs of one Muon param group -> the scaled update of each master, same shapes
Orthogonalizer = Callable[[list[tuple[torch.nn.Parameter, torch.Tensor]], dict], list[torch.Tensor]]


def whole_tensor_orthogonalizer(items: list[tuple[torch.nn.Parameter, torch.Tensor]],
                                group: dict) -> list[torch.Tensor]:
    """Each master is a whole weight: orthogonalise it as it is (per logical matrix of a fused weight)."""
    return [orthogonalize(u, group, getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1))
            for p, u in items]


@runtime_checkable
class WholeMatrixOptimizer(Protocol):
    """An optimizer whose update reads whole matrices: the engine binds the orthogonalizer that
    assembles them from however the data-parallel state and tensor parallelism cut the masters."""

    def bind_orthogonalizer(self, orthogonalizer: Orthogonalizer) -> None:
        """Use `orthogonalizer` for the Muon groups' updates from now on."""


class Muon(torch.optim.Optimizer):
    """Muon on the param groups with `use_muon` true, AdamW on the others (see the module doc).
    State per parameter: Muon's `momentum_buffer`; AdamW's `step`, `exp_avg`, `exp_avg_sq`.
    `adamw_params` is taken with the config's other keys but read before the optimizer exists: the
    engine splits the groups by it (muon_param_groups)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_dtype: str = "bfloat16", scale_mode: str = "shape", extra_scale_factor: float = 1.0,
                 weight_decay: float = 0.0, adamw_lr: float | None = 3e-4,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-10,
                 adamw_weight_decay: float = 0.0, adamw_params: Sequence[str] = DEFAULT_ADAMW_PARAMS):
        if not 0 <= momentum < 1 or ns_steps < 1 or scale_mode not in ("shape", "spectral"):
            raise ValueError(f"invalid Muon hyper-parameters: momentum={momentum}, ns_steps={ns_steps}, "
                             f"scale_mode={scale_mode!r}")
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        if not any("use_muon" in g for g in groups):
            raise ValueError("Muon needs param groups marked use_muon true/false (hidden matrices vs the rest): "
                             "build them with megazero.optim.muon.muon_param_groups(model, groups), or give Muon "
                             "as the engine config's optimizer, which does")
        muon = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype,
                    scale_mode=scale_mode, extra_scale_factor=extra_scale_factor, weight_decay=weight_decay)
        adamw = dict(lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                     weight_decay=adamw_weight_decay)
        # a group's own options win; each kind gets its defaults (torch fills only missing keys)
        groups = [{**(muon if g.get("use_muon") else adamw), **g} for g in groups]
        super().__init__(groups, dict(use_muon=False))
        self.orthogonalizer: Orthogonalizer = whole_tensor_orthogonalizer

    def bind_orthogonalizer(self, orthogonalizer: Orthogonalizer) -> None:
        """Assemble whole matrices with `orthogonalizer` (megazero.zero.whole_matrices)."""
        self.orthogonalizer = orthogonalizer

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        beta, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        items = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)
            items.append((p, p.grad.lerp(buf, beta) if group["nesterov"] else buf.clone()))
        # every rank calls the orthogonalizer, also with nothing of its own: it may communicate
        for (p, _), update in zip(items, self.orthogonalizer(items, group)):
            if decay:
                p.mul_(1 - lr * decay)
            p.add_(update.view_as(p), alpha=-lr)

    def _adamw_step(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = state["step"].item()
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(p.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            if decay:
                p.mul_(1 - lr * decay)
            denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))


def is_muon_matrix(name: str, param: torch.Tensor, adamw_params: Sequence[str] = DEFAULT_ADAMW_PARAMS) -> bool:
    """Muon's rule: a 2-D weight (or a 3-D stack of MoE experts' weights) whose name matches none of
    the `adamw_params` glob patterns."""
    # an expert parameter stacks its experts' tensors: 3-D is a stack of matrices, 2-D of biases
    matrices = param.dim() == (3 if getattr(param, "megazero_expert", False) else 2)
    return matrices and not any(fnmatch.fnmatchcase(name, pattern) for pattern in adamw_params)


def muon_param_groups(model: torch.nn.Module, groups: list[dict],
                      adamw_params: Sequence[str] = DEFAULT_ADAMW_PARAMS) -> list[dict]:
    """`groups` (param-group dicts over `model`'s parameters) each split in two: its Muon matrices
    (use_muon true) and the rest (use_muon false); empty halves dropped, other options kept."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = []
    for group in groups:
        for use_muon in (True, False):
            params = [p for p in group["params"]
                      if is_muon_matrix(names.get(id(p), ""), p, adamw_params) == use_muon]
            if params:
                out.append({**group, "params": params, "use_muon": use_muon})
    return out
