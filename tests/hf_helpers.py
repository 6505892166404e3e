"""The Hugging Face tests' one gate: skip, saying how to enable them, where transformers is absent."""

from __future__ import annotations

import pytest

ENABLE_HF = "transformers is not installed: `pip install -e .[hf]` (or `make install`) enables this test"


def require_transformers():
    """The transformers module, or a skip whose reason says how to install it."""
    return pytest.importorskip("transformers", reason=ENABLE_HF)


def transformers_windowed_loss(model, ids, window: int) -> float:
    """Mean next-token loss of a transformers causal LM over `ids` [n] in windows of `window` tokens
    without overlap, every target once: scripts/evaluate.py's default windows."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            end = min(start + window, len(ids) - 1)
            logits = model(ids[start:end].unsqueeze(0)).logits[0]
            total += float(F.cross_entropy(logits, ids[start + 1:end + 1], reduction="sum"))
    return total / (len(ids) - 1)
