"""An --offload-pattern putting only the routed experts' down stacks in the host tier, on the most
evenly spaced layers whose down stacks fit a budget (a probe: the same bytes as a whole-layer
placement spread over about three times the layers, for tools/predict_rate.py --pattern).

  python tools/down_pattern.py MODEL.gguf BUDGET_GIB   # prints the regex, and on stderr the layers
"""

from __future__ import annotations

import re
import sys

import gguf

from jaxvt.offload.plan import even_layers


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
    return 2
  budget = float(argv[1]) * 2**30
  sizes = {}
  for t in gguf.GGUFReader(argv[0]).tensors:
    m = re.fullmatch(r"blk\.(\d+)\.ffn_down_exps\.weight", t.name)
    if m:
      sizes[int(m.group(1))] = int(t.n_bytes)
  layers = sorted(sizes)
  for n in range(len(layers), 0, -1):
    chosen = [layers[i] for i in even_layers(len(layers), n)]
    total = sum(sizes[l] for l in chosen)
    if total <= budget:
      print(r"blk\.(" + "|".join(map(str, chosen)) + r")\.ffn_down_exps")
      print(f"{n} layers' down stacks, {total / 2**30:.4f} GiB: {chosen}", file=sys.stderr)
      return 0
  print("no layer's down stack fits the budget", file=sys.stderr)
  return 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
