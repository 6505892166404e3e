"""python -m megazero.ops build | report: pre-build every compatible op, or say where each stands.

`build` exits 1 if an op failed to build; under MEGAZERO_OPS_STRICT=1 also if an op was skipped as
incompatible here, so that a check meant to compile every op cannot pass having compiled none.
"""

from __future__ import annotations

import argparse
import sys

from megazero.ops import builder
from megazero.ops.aio import active_backend


def build_all() -> int:
    """Build every op; the number that failed (incompatible ones count only under strict mode)."""
    failed = 0
    for name, spec in builder.SPECS.items():
        reason = spec.incompatible()
        if reason and builder.strict():
            failed += 1
            print(f"{name}: FAILED: incompatible here and MEGAZERO_OPS_STRICT=1 ({reason})")
        elif reason:
            print(f"{name}: skipped ({reason})")
        else:
            ok = builder.load_op(name, verbose=False) is not None
            failed += not ok
            print(f"{name}: {'built' if ok else 'FAILED: ' + builder.status(name)['why']}")
    return failed


def print_report() -> None:
    """One line per op: compatible, built, loaded, falling back, and why; then the aio engine in use."""
    print(f"{'op':<16}{'compatible':>11}{'built':>7}{'loaded':>8}{'fallback':>10}  why")
    for name in builder.SPECS:
        s = builder.status(name)
        print(f"{name:<16}{str(s['compatible']):>11}{str(s['built']):>7}{str(s['loaded']):>8}"
              f"{str(s['fallback']):>10}  {s['why']}")
    print(f"aio engine: {active_backend()}")


def main(argv=None) -> int:
    """Entry point of `python -m megazero.ops`; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m megazero.ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "report"])
    args = parser.parse_args(argv)
    failed = build_all() if args.command == "build" else 0
    print_report()
    if failed:
        print(f"{failed} op(s) not built", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
