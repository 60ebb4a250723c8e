"""The benchmark harness and the performance reports (docs/performance.md).

- ``python -m jax_fp8norm.bench``: device time of the fused kernels beside the other ways
  of computing the same thing (:mod:`.cli`), built from
  :mod:`.ops` (the ops, their bytes and inputs), :mod:`.presets` (the shape grids),
  :mod:`.registry` and :mod:`.implementations` (what is timed), :mod:`.timing` (how),
  :mod:`.runner` (one shape, one run), :mod:`.report` (table, summary, JSON) and
  :mod:`.figure` (the PNG; ``python -m jax_fp8norm.bench.figure`` draws it from a JSON).
- ``python -m jax_fp8norm.bench.block_scaling``: the scale layouts of rms_norm_fp8 on one
  shape, their calls interleaved.

Two reports need a source checkout and live in its tools/reports/: the CUDA kernels'
memory traffic, emulated (``simt_memory_report.py``), and their registers and spills from
nvcc (``ptxas_report.py``).

The modules are imported one by one (``from jax_fp8norm.bench import runner``): importing
this package runs nothing and loads neither jax's backends nor matplotlib.
"""
