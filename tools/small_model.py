"""Writes a synthetic GGUF model with SmolLM2-135M's shapes (llama, 30 layers, d_model 576, 9
heads / 3 KV heads of 64, FFN 1536, vocabulary 49,152, tied embeddings, Q4_1): the embedded
default model's size, for timing the CLI on a machine where the default model's package is not
installed (the lent GPU has no network).

  python tools/small_model.py OUT.gguf
"""

from __future__ import annotations

import sys

from jaxvt import synth


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
    return 2
  cfg = synth.tiny_config("llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3,
                          head_dim=64, rope_dim=64, ffn_dim=1536, vocab_size=49152,
                          tied_embeddings=True, context_length=8192, rope_interleaved=False)
  synth.write_model(argv[0], cfg, "q4_1", seed=1)
  print(argv[0])
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
