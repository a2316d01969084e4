"""Measuring: exact work counts, and timings on this machine.

  flops         attention score cells, forward FLOPs, arithmetic intensity (exact: lessons assert them)
  recorder      the one op recorder: what a call ran (matmuls, score matrices, every tensor made)
  tolerance     the one rule for comparing two float computations (against float64)
  hf            Hugging Face GPT-2: the reference model the engine is checked and benchmarked against
  profile       wall time, peak memory, GEMM throughput, a forward's time split (measured: shown, never asserted)
  bench         python -m lessons_lib.measure.bench: varlen vs masked vs padded vs Hugging Face
  bench_report  the benchmark's plots and Markdown tables
  gpu_bench     python -m lessons_lib.measure.gpu_bench: bf16 GEMM peak, attention kernels and the engine on a GPU
"""
