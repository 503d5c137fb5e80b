"""python -m benchmarks: the list of benchmarks; `python -m benchmarks NAME [options]` runs one,
as `python -m benchmarks.NAME [options]` does."""

from __future__ import annotations

import importlib
import sys

# name -> what it measures (each is the module benchmarks.<name>, with its own --help)
BENCHMARKS = {
    "offload": "a Qwen3.6-35B-A3B-shaped model in an emulated 16 GiB GPU, budget by budget, "
               "against JAX's pinned_host and llama.cpp (GPU)",
    "tier": "host-tier read rate against the link; --products: in place / tiled / staged "
            "products by rows; --grid, --kinds: kernel-alone probes (GPU; CPU runs it too)",
    "kernels": "qmatmul GB/s from the host and device tiers, printed (no section)",
    "phases": "where a one-row bulk-copy matvec launch spends its cycles, phase by phase (an "
              "extension built with -DJAXVT_MV_PHASES=1; NVIDIA sm_90+; printed)",
    "cpu": "jaxvt against llama.cpp (llama-cpp-python) on the default model (CPU)",
    "profile": "where a decode step's (or a prefill's) device time goes (jax.profiler)",
    "mesh": "tp=2 against one device, with and without offload (2 GPUs)",
    "determinism": "the same tokens across processes and budgets, and what it costs",
    "invariance": "the cost of scheduling-invariant arithmetic: decode 1 / 8 rows, prefill 151 / "
                  "512 tokens, against llama.cpp's recipe choice (CPU)",
    "fusion": "a fused step on and off (the residual stream in one call): decode 1 / 8 rows, "
              "prefill 512 tokens, side by side",
    "first_token": "seconds from starting `python -m jaxvt.run` to its first token, cold and "
                   "from the caches",
    "long_prompt": "a long prompt (8192 tokens) at --offload-gb auto on an emulated card",
    "serve": "jaxvt.serve against llama-server over HTTP: prompt reuse, 1-8 streams, memory per "
             "sequence (GPU)",
    "structured": "what constrained decoding (a JSON schema) costs per token, the matcher "
                  "libraries compared, packed masks against a float bias",
    "routing": "a MoE model's expert choices in a decode: reuse, skew, next-layer predictability",
    "cache": "the device-side expert cache by budget: LRU, LFRU, prediction, llama.cpp (GPU)",
    "turns": "a chat's short next turn through the expert cache against streaming its experts, "
             "and 1 against 8 decode rows sharing expert reads (GPU)",
}


def usage() -> str:
  lines = ["python -m benchmarks.<name> [options]   (from the repository root; --help for each)",
           ""]
  lines += [f"  {name:12} {what}" for name, what in BENCHMARKS.items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help", "list"):
    print(usage())
    return 0
  if argv[0] not in BENCHMARKS:
    print(f"benchmarks: no benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
    return 2
  return importlib.import_module(f"benchmarks.{argv[0]}").cli(argv[1:])


if __name__ == "__main__":
  sys.exit(main())
