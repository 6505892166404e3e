"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, causal SDPA attention, tied embeddings.

Plain and meant to be forked. Sizes come from GPTConfig; configs/ holds the CPU-sized default and
GPT-2 124M / 350M / 774M / 1.5B.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.activation_checkpointing import checkpoint


@dataclass
class GPTConfig:
    """Model shape. vocab_size is padded up to a multiple of `make_vocab_size_divisible_by`."""

    vocab_size: int = 8000
    seq_length: int = 256
    num_layers: int = 6
    hidden_size: int = 384
    num_attention_heads: int = 6
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    recompute_granularity: str | None = None  # "full": whole layers; "selective": the attention core
    recompute_num_layers: int | None = None  # with "full": only the first N layers (default: all)

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be 'full' or 'selective', got {self.recompute_granularity!r}")

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up so the embedding splits evenly (Megatron's padding)."""
        m = self.make_vocab_size_divisible_by
        return ((self.vocab_size + m - 1) // m) * m

    @classmethod
    def from_json(cls, path: str, **overrides) -> GPTConfig:
        """Read a model config JSON (keys as the fields), with overrides for non-None values."""
        with open(path) as f:
            values = json.load(f)
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown model config keys {sorted(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_dict(self) -> dict:
        """Plain dict of the fields (for checkpoints and logs)."""
        return asdict(self)


def gpt2_linear(in_features: int, out_features: int, config: GPTConfig, residual: bool = False) -> nn.Linear:
    """A Linear with GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers), zero bias.

    Initialised where it is created: under zero.Init a layer is partitioned as soon as its parent is built.
    """
    linear = nn.Linear(in_features, out_features)
    std = 0.02 / math.sqrt(2 * config.num_layers) if residual else 0.02
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    nn.init.zeros_(linear.bias)
    return linear


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = gpt2_linear(config.hidden_size, 3 * config.hidden_size, config)
        self.proj = gpt2_linear(config.hidden_size, config.hidden_size, config, residual=True)
        self.dropout = config.dropout
        self.recompute_core = config.recompute_granularity == "selective"

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.num_heads, hidden // self.num_heads).transpose(1, 2) for t in (q, k, v))
        if self.recompute_core and torch.is_grad_enabled():  # selective recompute: only the attention core
            y = checkpoint(self._core, q, k, v)
        else:
            y = self._core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(batch, seq, hidden)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """hidden -> ffn -> GELU -> hidden."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = gpt2_linear(config.hidden_size, config.ffn_hidden_size, config)
        self.proj = gpt2_linear(config.ffn_hidden_size, config.hidden_size, config, residual=True)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 language model. forward(input_ids, labels=None) -> mean cross-entropy loss or logits."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.seq_length, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        nn.init.normal_(self.wte.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Trainable parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        seq = input_ids.shape[1]
        if seq > self.config.seq_length:
            raise ValueError(f"sequence of {seq} tokens is longer than seq_length {self.config.seq_length}")
        positions = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        full = self.config.recompute_granularity == "full" and torch.is_grad_enabled()
        layers = self.config.recompute_num_layers
        recompute = layers if layers is not None else len(self.blocks)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x) if full and i < recompute else block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output embedding
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, vocab_size: int | None = None) -> torch.Tensor:
        """Sample continuations (greedy when temperature == 0); padding ids are never sampled."""
        vocab_size = vocab_size or self.config.vocab_size
        for _ in range(max_new_tokens):
            context = input_ids[:, -self.config.seq_length:]
            logits = self(context)[:, -1, :vocab_size].float()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            input_ids = torch.cat([input_ids, next_id], dim=1)
        return input_ids
