"""Documents packed into one GPT sample: Megatron's --reset-position-ids, --reset-attention-mask and
--eod-mask-loss (its get_ltor_masks_and_position_ids), as fields of the sample.

A sample is a window of the token stream, whose documents each end with the end-of-document token.
A document is its tokens up to and including that token; the next one starts after it (the first
one of a window starts at the window's start). The fields, per input position t:
  position_ids  t - the start of t's document (--reset-position-ids: positions restart per document)
  document_ids  the number of end-of-document tokens before t (--reset-attention-mask: a token sees
                the earlier tokens of its own document only)
  loss_mask     0 where the input token is the end-of-document token, 1 elsewhere (--eod-mask-loss:
                no loss for predicting across a document boundary)
The models take them as keyword arguments of the same names (models/gpt.py, models/llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentPacking:
    """Which of Megatron's three flags are on, and the end-of-document id they split on."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def enabled(self) -> bool:
        """Whether any flag is on (else a sample is input_ids and labels alone)."""
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    def fields(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields the flags add to a sample of `input_ids` ([seq], int64)."""
        is_eod = (input_ids == self.eod).long()
        out = {}
        if self.reset_position_ids or self.reset_attention_mask:
            document = torch.cumsum(is_eod, 0) - is_eod  # the eod itself belongs to the document it ends
            if self.reset_attention_mask:
                out["document_ids"] = document
            if self.reset_position_ids:
                starts = torch.cat([input_ids.new_zeros(1), torch.nonzero(is_eod).flatten() + 1])
                out["position_ids"] = torch.arange(len(input_ids)) - starts[document]
        if self.eod_mask_loss:
            out["loss_mask"] = (1 - is_eod).float()
        return out
