"""Tokenizer, indexed memory-mapped datasets, GPT samples and a resumable data-parallel loader."""

from megazero.data.gpt_dataset import GPTDataset
from megazero.data.indexed_dataset import (
    DatasetFormatError,
    IndexedDataset,
    best_dtype,
    write_indexed_dataset,
)
from megazero.data.loader import DistributedBatchLoader, MultiEpochDataset, collate
from megazero.data.tokenizer import Tokenizer, TokenizerSpec, build_tokenizer
from megazero.data.tokenizer_sentencepiece import SentencePieceTokenizer, train_sentencepiece
from megazero.data.vocab_check import check_token_ids, token_id_range

__all__ = ["GPTDataset", "IndexedDataset", "DatasetFormatError", "best_dtype", "write_indexed_dataset",
           "DistributedBatchLoader", "MultiEpochDataset", "collate", "SentencePieceTokenizer", "train_sentencepiece",
           "Tokenizer", "TokenizerSpec", "build_tokenizer",
           "check_token_ids", "token_id_range"]
