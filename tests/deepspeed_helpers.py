"""A user's own model and data in the shape DeepSpeed's tutorials use (forward(batch) -> loss), for
the tests of the DeepSpeed-facing engine API. Module level, so test pools can run functions using them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import megazero

FEATURES = 8


class TinyNet(torch.nn.Module):
    """Embedding-like input map tied to the output map, two hidden layers in an nn.ModuleList (ZeRO-3
    units), dropout between them; forward(batch) returns the mean squared error."""

    def __init__(self, dropout: float = 0.2, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Linear(FEATURES, FEATURES, bias=False)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(FEATURES, width), torch.nn.Linear(width, FEATURES)])
        self.unembed = torch.nn.Linear(FEATURES, FEATURES, bias=False)
        self.unembed.weight = self.embed.weight  # tied, as language models tie their embeddings
        self.norm = torch.nn.LayerNorm(FEATURES)
        self.register_buffer("target_scale", torch.tensor(0.5))
        self.dropout = dropout

    def forward(self, batch: dict) -> torch.Tensor:
        h = self.embed(batch["x"].to(self.embed.weight.dtype))
        h = F.dropout(torch.relu(self.layers[0](h)), self.dropout, self.training)
        out = self.unembed(self.norm(self.layers[1](h))).sum(-1)
        return F.mse_loss(out.float(), batch["y"] * self.target_scale)


class TinyNetWithExtra(TinyNet):
    """TinyNet plus a parameter its checkpoints lack (a new head when warm-starting)."""

    def __init__(self, dropout: float = 0.2):
        super().__init__(dropout)
        self.extra = torch.nn.Linear(FEATURES, 1)


class RegressionData(torch.utils.data.Dataset):
    """`n` fixed samples {"x": 8 features, "y": a noisy function of them}."""

    def __init__(self, n: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.sin(self.x).sum(-1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def tiny_config(stage: int = 0, micro: int = 2, accumulation: int = 1, **extra) -> dict:
    """AdamW with a warm-up schedule (so a resumed schedule shows), ZeRO `stage`."""
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def sgd_config(stage: int = 0, accumulation: int = 1, lr: float = 0.1, **extra) -> dict:
    """tiny_config with plain SGD at a constant LR (no schedule), so one step shows the gradient."""
    config = tiny_config(stage, accumulation=accumulation, optimizer={"type": "SGD", "params": {"lr": lr}}, **extra)
    config.pop("scheduler")
    return config


def build_tiny(config: dict, seed: int = 0, dropout: float = 0.2, args=None, model_class=None):
    """Seeded TinyNet (or `model_class`) + engine over RegressionData, as a user's script builds them."""
    torch.manual_seed(seed)
    net = (model_class or TinyNet)(dropout)
    engine, optimizer, loader, _ = megazero.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                       training_data=RegressionData(), config=config)
    return engine, loader
