"""jaxvt's benchmarks: `python -m benchmarks.<name>` from the repository root.

They compose jaxvt's public steps (open, plan, place, run) and write their sections of
docs/BENCHMARKS.md (benchmarks.report). The comparison arms (JAX's pinned_host memory kind,
llama.cpp's llama-bench) live here, not in the package; the wheel does not ship this directory.
`python -m benchmarks` lists the benchmarks.
"""
