"""The benchmarks (each a script: `python benchmarks/bench_zero.py`), the helper they write their
results with (benchmarks/record.py) and the page generated from those results
(`python -m benchmarks.report`, docs/benchmarks.md)."""
