"""The Hugging Face tests' one gate: skip, saying how to enable them, where transformers is absent."""

from __future__ import annotations

import pytest

ENABLE_HF = "transformers is not installed: `pip install -e .[hf]` (or `make install`) enables this test"


def require_transformers():
    """The transformers module, or a skip whose reason says how to install it."""
    return pytest.importorskip("transformers", reason=ENABLE_HF)
