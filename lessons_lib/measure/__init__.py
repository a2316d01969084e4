"""Measuring: exact work counts, machines, and timings on this machine.

  flops         attention score cells, forward FLOPs, bytes, arithmetic intensity, the block's linear shapes (exact)
  machines      Machine: H200 and A100 (datasheets), the CPU the course was built on, this_cpu() (measured)
  comm          the alpha-beta model of a ring all-reduce (AlphaBeta, its fit, ring_time_terms, crossover_tokens)
  search        first_where: the smallest n where a monotone predicate turns true (every "first length where X crosses")
  recorder      the one op recorder: what a call ran (matmuls, score matrices, every tensor made)
  tolerance     the one rule for comparing two float computations (against float64)
  batch_invariance  does a step give each request what it gets alone: a block cut into its steps, alone vs flat
  hf            Hugging Face GPT-2: the reference model the engine is checked and benchmarked against
  profile       wall time, peak memory, GEMM throughput, a forward's time split (measured: shown, never asserted)
  bench         python -m lessons_lib.measure.bench: varlen vs masked vs padded vs Hugging Face
  bench_report  the benchmark's plots and Markdown tables
  gpu_bench     python -m lessons_lib.measure.gpu_bench: bf16 GEMM peak, attention kernels and the engine on a GPU
"""
