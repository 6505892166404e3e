"""Rebuild one full fp32 state dict from a megazero checkpoint of any ZeRO stage and DP size.

    python scripts/zero_to_fp32.py CHECKPOINT_DIR OUTPUT [--tag TAG]

OUTPUT ending in .safetensors is written as safetensors, anything else as a torch file that
loads with torch.load(..., weights_only=True).
"""

from __future__ import annotations

import argparse

from megazero.checkpoint.consolidate import consolidate_fp32_state_dict, save_consolidated


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", help="the directory holding `latest` and the tag directories")
    parser.add_argument("output", help="output file (.safetensors or a torch file)")
    parser.add_argument("--tag", default=None, help="default: the tag named by `latest`")
    args = parser.parse_args(argv)
    state_dict = consolidate_fp32_state_dict(args.checkpoint_dir, args.tag)
    save_consolidated(state_dict, args.output)
    total = sum(t.numel() for t in state_dict.values())
    print(f"wrote {len(state_dict)} tensors, {total:,} elements, to {args.output}")


if __name__ == "__main__":
    main()
