"""Command-line scripts that need no data: the memory estimate."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_estimate_memory_for_gpt2_xl_on_64_ranks():
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "estimate_memory.py"), "--model-config",
                          os.path.join(REPO, "configs", "gpt2_1.5b.json"), "--num-ranks", "64"],
                         capture_output=True, text=True, check=True).stdout
    assert "1,557.7 M parameters, 64 data-parallel ranks" in out
    rows = [line.split() for line in out.splitlines() if line[:2] in ("0 ", "1 ", "2 ", "3 ")]
    totals = [float(row[4]) for row in rows]
    assert len(rows) == 4 and totals == sorted(totals, reverse=True)
    psi = float(out.split(" M parameters")[0].replace(",", "")) * 1e6
    assert abs(float(rows[3][4]) - 18 * psi / 64 / 2**30) < 0.01  # stage 3, bf16: 18 bytes / parameter / N


def test_estimate_memory_reads_the_llama_configs():
    """Each Llama config counts as its model: Llama 2 7B / 13B's and Llama 3.2 1B's published sizes."""
    import contextlib
    import io

    from scripts.estimate_memory import main

    for name, millions in (("llama_1b", "1,235.8"), ("llama_7b", "6,738.4"), ("llama_13b", "13,015.9")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["--model-config", os.path.join(REPO, "configs", f"{name}.json")])
        assert out.getvalue().startswith(f"{millions} M parameters"), (name, out.getvalue())


def test_estimate_memory_notes_sub_groups_that_do_not_bound_the_optimizer_offload():
    """A sub_group_size of a rank's whole partition, or below the master chunk it cannot split, is
    named with the flag that changes it; a sub-group that bounds the step gets no note."""
    import contextlib
    import io

    from scripts.estimate_memory import main

    def notes(*flags: str) -> list[str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["--num-ranks", "2", "--offload-optimizer", "nvme", *flags])
        return [line for line in out.getvalue().splitlines() if line.startswith("note: ")]

    [whole] = notes()  # the default sub_group_size, 1e9, covers a rank's 778.8 M elements
    assert ">= a rank's partition (778,843,200 elements)" in whole and "--sub-group-size" in whole
    [chunk] = notes("--sub-group-size", "100000000")  # under a 250 M-element chunk (5e8 bucket / 2)
    assert "below a master chunk (250,000,000 elements" in chunk and "--reduce-bucket-size" in chunk
    assert notes("--sub-group-size", "100000000", "--reduce-bucket-size", "50000000") == []
