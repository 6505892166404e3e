"""Join the outputs of a partitioned preprocessing run (scripts/preprocess_data.py --partitions K)
into the dataset family one run over all the inputs writes, byte for byte (.bin, .idx, _stats.json).

    python scripts/merge_datasets.py --output-prefix P --partitions K     # P_part0ofK ... P_part<K-1>ofK
    python scripts/merge_datasets.py --output-prefix P --inputs A B C     # any prefixes, in this order
"""

from __future__ import annotations

import argparse
import sys

from megazero.data.preprocess import entropy_report
from megazero.data.preprocess_plan import merge_partitions, partition_prefix


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-prefix", required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--partitions", type=int, help="merge P_part<i>of<K> for i = 0 .. K-1")
    source.add_argument("--inputs", nargs="+", help="dataset prefixes to join, in order")
    args = p.parse_args(argv)
    prefixes = args.inputs or [partition_prefix(args.output_prefix, i, args.partitions) for i in range(args.partitions)]
    try:
        print(entropy_report(merge_partitions(prefixes, args.output_prefix)))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"merge_datasets.py: {e}")


if __name__ == "__main__":
    main()
