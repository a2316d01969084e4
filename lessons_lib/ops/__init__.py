"""Kernels written for the course: a varlen attention forward in Triton (``triton_varlen``), the
pure-Python model of how it tiles its work (``tiling``, importable without Triton), and what the
compiler makes of it for sm_80 / sm_90 without a GPU (``compile_report``: registers, spills, shared memory).

``triton_varlen`` imports Triton (Linux wheels only); on a machine without a GPU it switches Triton
to its interpreter first. ``tiling`` needs nothing but the standard library and ``validate``.

Taught in notebooks/07_inside_the_kernel.ipynb.
"""
