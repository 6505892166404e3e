"""python -m megazero.ops build | report: pre-build every compatible op, or say where each stands."""

from __future__ import annotations

import argparse
import sys

from megazero.ops.builder import SPECS, load_op, status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megazero.ops", description=__doc__)
    parser.add_argument("command", choices=["build", "report"])
    args = parser.parse_args(argv)
    failed = 0
    if args.command == "build":
        for name, spec in SPECS.items():
            if spec.incompatible():
                print(f"{name}: skipped ({spec.incompatible()})")
                continue
            ok = load_op(name, verbose=False) is not None
            failed += not ok
            print(f"{name}: {'built' if ok else 'FAILED: ' + status(name)['why']}")
    print(f"{'op':<16}{'compatible':>11}{'built':>7}{'loaded':>8}{'fallback':>10}  why")
    for name in SPECS:
        s = status(name)
        print(f"{name:<16}{str(s['compatible']):>11}{str(s['built']):>7}{str(s['loaded']):>8}"
              f"{str(s['fallback']):>10}  {s['why']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
