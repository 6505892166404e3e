"""Tokenize a corpus into indexed memory-mapped datasets (train/valid split by documents), streaming.

Input: text files (one document each), jsonl files (one {"text": ...} document per line; also
.jsonl.gz and .jsonl.zst) and tables (.parquet, .arrow: one document per row, the "text" column),
given as files or directories (a Hugging Face `datasets` save_to_disk directory reads its shards).
Output, for --output-prefix P:
  P_tokenizer.model/.vocab         sentencepiece BPE (trained on the train documents, the first
                                   --tokenizer-train-mb of them, unless a tokenizer is given:
                                   --tokenizer-type and its files, as the recipes take them)
  P_train_text_document.bin/.idx   train documents, each ending with the end-of-document token
  P_valid_text_document.bin/.idx   validation documents (--valid-fraction 0: one P_text_document,
                                   Megatron's layout, split at training time by --split)
  P_stats.json                     token counts and the unigram entropy of the train tokens
--workers N tokenizes in N processes, --chunk-mb of text at a time; the output is the same for
any N and memory does not grow with the corpus. --output-per-input writes P_<file stem>_... per
input file (to blend them); --partitions K --partition-index i writes the i-th of K blocks of the
input files to P_part<i>of<K>_... (scripts/preprocess_data.sbatch runs them as a Slurm array and
scripts/merge_datasets.py joins them into what one run writes).
"""

from __future__ import annotations

import argparse
import sys

from megazero.data.preprocess import Options, entropy_report
from megazero.data.preprocess_plan import plan, train_tokenizer, write_group
from megazero.data.sources import BadLineError, input_files
from megazero.data.tokenizer import TokenizerSpec, add_tokenizer_args, canonical_type, spec_from_args


def parse_args(argv=None) -> argparse.Namespace:
    """The flags (those before streaming keep their names and defaults)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="text, jsonl(.gz/.zst), parquet or arrow files, or directories (a datasets save_to_disk one)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--vocab-size", type=int, default=8000)
    add_tokenizer_args(p)  # no --tokenizer-model: a sentencepiece model is trained on the corpus
    p.add_argument("--tokenizer-train-mb", type=float, default=256,
                   help="train a new tokenizer on at most this much of the train text (default 256)")
    p.add_argument("--train-tokenizer-only", action="store_true",
                   help="write P_tokenizer.model and stop (the shared tokenizer of a partitioned run)")
    p.add_argument("--valid-fraction", type=float, default=0.05, help="0: no split (one P_text_document)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--split-sentences", action="store_true",
                   help="BERT: one sequence per sentence, grouped by document (P_{train,valid}_text_sentence)")
    p.add_argument("--special-tokens", nargs="*", default=[],
                   help="pieces of their own in a newly trained tokenizer, e.g. [CLS] [SEP] [MASK] [PAD]")
    p.add_argument("--json-key", default="text",
                   help="the field of each jsonl object, or the column of a parquet/arrow table, holding the text")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) jsonl lines that are not a JSON object with the key (default: stop)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--chunk-mb", type=float, default=4, help="text per chunk a worker tokenizes at once")
    p.add_argument("--log-interval", type=int, default=0,
                   help="print a plain progress line every this many documents instead of a progress bar")
    p.add_argument("--output-per-input", action="store_true", help="one output P_<file stem> per input file")
    p.add_argument("--partitions", type=int, default=1, help="split the input files into this many blocks")
    p.add_argument("--partition-index", type=int, default=0, help="the block this run writes")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    opts = Options(json_key=args.json_key, skip_bad_lines=args.skip_bad_lines, split_sentences=args.split_sentences,
                   workers=args.workers, chunk_bytes=int(args.chunk_mb * 2**20), log_interval=args.log_interval,
                   valid_fraction=args.valid_fraction, seed=args.seed)
    try:
        every, mine = plan(input_files(args.input), args.output_prefix, opts, args.output_per_input,
                           args.partitions, args.partition_index)
        if args.tokenizer_model is None and args.vocab_file is None:
            if args.partitions > 1 and not args.train_tokenizer_only:
                sys.exit("--partitions: every partition needs the same --tokenizer-model; make it first with "
                         "--train-tokenizer-only (scripts/preprocess_data.sbatch does)")
            if args.tokenizer_type is not None and canonical_type(args.tokenizer_type) != "sentencepiece":
                sys.exit(f"--tokenizer-type {args.tokenizer_type}: give its files (--tokenizer-model, or --vocab-file "
                         f"and --merge-file); only a sentencepiece tokenizer is trained on the corpus")
            spec = TokenizerSpec(model=train_tokenizer(every, args.output_prefix, opts, args.vocab_size,
                                                       args.special_tokens, int(args.tokenizer_train_mb * 2**20)))
        else:
            spec = spec_from_args(args)
        if args.train_tokenizer_only:
            print(f"tokenizer {spec.model}")
            return
        for group in mine:
            print(entropy_report(write_group(group, spec, opts)), flush=True)
    except (BadLineError, FileNotFoundError, ValueError) as e:
        sys.exit(f"preprocess_data.py: {e}")


if __name__ == "__main__":
    main()
