"""Measuring: exact work counts, and timings on this machine.

  flops         attention score cells, forward FLOPs, arithmetic intensity (exact: lessons assert them)
  profile       wall time, peak memory, GEMM throughput, a forward's time split (measured: shown, never asserted)
  bench         python -m lessons_lib.measure.bench: varlen vs masked vs padded vs Hugging Face
  bench_report  the benchmark's plots and Markdown tables
"""
