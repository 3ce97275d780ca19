"""tritamp's benchmarks, run from the repository root as modules.

- ``python3 -m benchmarks.opt_levels``: the main job, every opt level against torch.amp
  (also runs as ``python3 benchmarks/opt_levels.py``);
- ``python3 -m benchmarks.kernels``: every kernel benchmark in one table (it gathers
  ``benchmarks.optimizers``, ``benchmarks.norms`` and the unscale/norm sweeps);
- ``python3 -m benchmarks.optimizers``, ``benchmarks.norms``, ``benchmarks.syncbn``;
- ``python3 -m benchmarks.host_overhead``: the Python a fused step pays, launches recorded;
- ``python3 -m benchmarks.compile_report``: registers, spills and load widths of every
  kernel compiled for sm_90 without a GPU.

Results go to ``benchmarks/out/``; GPU runs are kept under ``benchmarks/results/``.
"""
