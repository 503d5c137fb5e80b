"""Greedy tokens of different prompts decoded together in one batch equal each decoded alone."""

import numpy as np

from jaxvt.serve.batch import BatchSession
from test_serve_fixtures import smol  # noqa: F401  (fixture)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fib(n):", "Once upon a time"]
STEPS = 12


GREEDY = (0.0, 0, 1.0, 0, 0, {}, 0.0, 0.0)  # sample's row parameters of a greedy row


def _greedy(s: BatchSession, slots: dict[int, list[int]]) -> dict[int, list[int]]:
  out = {k: [int(np.argmax(s.prefill(k, p)[0]))] for k, p in slots.items()}
  for steps in (1, 3, 8):  # one device program of each length, STEPS steps in all
    toks, _ = s.decode({k: (v[-1], GREEDY) for k, v in out.items()}, steps)
    for k in out:
      out[k] += toks[:, k].tolist()
  return out


def _alone(eng, prompt: list[int]) -> list[int]:
  """The engine's own single-sequence path (prefill + decode_step), not BatchSession."""
  logits, cache = eng.prefill(prompt)
  out = [int(np.argmax(logits))]
  for i in range(STEPS):
    logits, cache = eng.decode_step(cache, out[-1], len(prompt) + i)
    out.append(int(np.argmax(logits)))
  return out


def test_batched_greedy_equals_alone(smol):
  eng = smol
  prompts = [eng.encode_prompt(p) for p in PROMPTS]
  together = _greedy(BatchSession(eng, 4), dict(enumerate(prompts)))
  for i, p in enumerate(prompts):
    alone = _alone(eng, p)
    assert together[i] == alone, (i, together[i], alone)
