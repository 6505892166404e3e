"""Module-level training functions that test pools run on every rank."""

from __future__ import annotations

import megazero
from megazero.data import GPTDataset, IndexedDataset
from megazero.distributed import all_reduce_values
from megazero.zero import GatheredParameters
from models.gpt import GPT, GPTConfig

TINY = dict(vocab_size=256, seq_length=32, num_layers=2, hidden_size=64, num_attention_heads=4,
            make_vocab_size_divisible_by=64)


def base_config(**overrides) -> dict:
    """A small fp32 engine config; keyword overrides replace top-level keys."""
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 3,
                                                     "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 20000},
        "steps_per_print": 1000,
    }
    config.update(overrides)
    return config


def build_engine(config: dict, prefix: str, seed: int = 0, model_overrides: dict | None = None):
    """Seeded tiny GPT + engine over the indexed dataset at `prefix`."""
    megazero.set_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **(model_overrides or {})}))
    dataset = GPTDataset(IndexedDataset(prefix), TINY["seq_length"], seed=seed)
    engine, _, loader, _ = megazero.initialize(model=model, training_data=dataset, config=config)
    return engine, loader


def global_mean(value: float, engine) -> float:
    """Average a float over the data-parallel group."""
    return all_reduce_values([value], group=engine.dp_group)[0] / engine.dp_world_size


def train(config: dict, prefix: str, steps: int, seed: int = 0, save_dir: str | None = None,
          save_at: int | None = None, load_dir: str | None = None, model_overrides: dict | None = None) -> dict:
    """Train `steps` optimizer steps (after loading from load_dir, if given); returns per-step global
    losses and the final parameters. Saves at step `save_at` when save_dir is given."""
    engine, loader = build_engine(config, prefix, seed, model_overrides)
    if load_dir is not None:
        path, client = engine.load_checkpoint(load_dir)
        assert path is not None and client["step"] == engine.global_steps
    data = iter(loader)
    losses = []
    while engine.global_steps < steps:
        loss = engine.train_batch(data)
        losses.append(global_mean(loss.item(), engine))
        if save_dir is not None and engine.global_steps == save_at:
            engine.save_checkpoint(save_dir, client_state={"step": engine.global_steps})
    with GatheredParameters(list(engine.module.parameters())):  # whole again under ZeRO-3
        params = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params, "skipped": engine.skipped_steps, "lr": engine.get_lr()[0],
            "scale": engine.get_loss_scale()}
