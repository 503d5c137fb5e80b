"""Requests submitted together to the engine loop get the engine's solo greedy tokens."""

import numpy as np

from jaxvt import engine as engine_mod
from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.scheduler import Request

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fib(n):", "Once upon a time", "Hi"]
N = 8


def _alone(eng, prompt):
  logits, cache = eng.prefill(prompt)
  out = [int(np.argmax(logits))]
  for i in range(N - 1):
    logits, cache = eng.decode_step(cache, out[-1], len(prompt) + i)
    out.append(int(np.argmax(logits)))
  return out


def test_concurrent_requests_equal_solo_greedy():
  eng = engine_mod.load(max_context=128)
  try:
    loop = EngineLoop(eng, max_batch=3, max_queue=8)  # 5 requests, 3 slots: two join later
    reqs = [Request(prompt=eng.encode_prompt(p), max_tokens=N) for p in PROMPTS]
    events = [loop.submit(r) for r in reqs]
    assert all(ev.wait(120) for ev in events)
    loop.close()
    for r in reqs:
      assert r.finish_reason == "length" and r.tokens == _alone(eng, r.prompt)
  finally:
    eng.close()
