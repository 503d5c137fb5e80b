"""The engine loop: requests submitted together get the engine's solo greedy tokens (the default
model, and a hybrid Gated-DeltaNet MoE file whose recurrent state a padded row must not touch);
a seeded sampled request gets the same tokens alone and in a batch; a chat's next turn reuses
the first turn's state (prefix cache) and gets the tokens of a run without reuse; a request
cancelled mid-way frees its slot for the next."""

import numpy as np
import pytest

from jaxvt.prefix import PrefixCache
from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.scheduler import Request
from test_serve_fixtures import ATOL, agree_up_to_a_tie, hybrid, smol  # noqa: F401  (fixtures)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fib(n):", "Once upon a time", "Hi"]
N = 8


def _alone(eng, prompt, n=N):
  """The engine's own single-sequence path (prefill + decode_step), greedy."""
  logits, cache = eng.prefill(prompt)
  out = [int(np.argmax(logits))]
  for i in range(n - 1):
    logits, cache = eng.decode_step(cache, out[-1], len(prompt) + i)
    out.append(int(np.argmax(logits)))
  return out


def _run(loop, reqs, timeout=300):
  events = [loop.submit(r) for r in reqs]
  assert all(ev.wait(timeout) for ev in events)
  return reqs


@pytest.mark.parametrize("which", ["smol", "hybrid"])
def test_concurrent_requests_equal_solo_greedy(which, request):
  eng = request.getfixturevalue(which)
  loop = EngineLoop(eng, max_batch=3, max_queue=8)  # 5 requests, 3 slots: two join later
  try:
    ids = [eng.encode_prompt(p) if which == "smol" else
           np.random.default_rng(i).integers(5, eng.cfg.vocab_size, 9 + 3 * i).tolist()
           for i, p in enumerate(PROMPTS)]
    # different lengths: requests finish while others decode, and the rest move down (compaction)
    reqs = _run(loop, [Request(prompt=p, max_tokens=N - 2 * (i % 3)) for i, p in enumerate(ids)])
  finally:
    assert loop.close()
  for r in reqs:
    assert r.finish_reason == "length" and r.tokens == _alone(eng, r.prompt, r.max_tokens), r.id


def test_seeded_sampling_is_the_same_alone_and_batched(smol):
  loop = EngineLoop(smol, max_batch=4, max_queue=8)
  try:
    kw = dict(max_tokens=N, temperature=0.9, top_p=0.95, seed=1234)
    alone = _run(loop, [Request(prompt=smol.encode_prompt(PROMPTS[0]), **kw)])[0]
    batch = _run(loop, [Request(prompt=smol.encode_prompt(p), **kw) for p in PROMPTS[:4]])
    other = _run(loop, [Request(prompt=smol.encode_prompt(PROMPTS[0]), **{**kw, "seed": 1})])[0]
  finally:
    loop.close()
  assert batch[0].tokens == alone.tokens and other.tokens != alone.tokens


@pytest.mark.parametrize("which", ["smol", "hybrid"])
def test_next_turn_reuses_the_finished_sequence(which, request):
  eng = request.getfixturevalue(which)
  prefix = PrefixCache(eng, budget_bytes=1 << 30, interval=16)
  loop = EngineLoop(eng, max_batch=2, max_queue=4, prefix=prefix)
  try:
    first = np.random.default_rng(5).integers(5, eng.cfg.vocab_size, 21).tolist()
    r1 = _run(loop, [Request(prompt=first, max_tokens=N)])[0]
    turn2 = r1.fed + np.random.default_rng(6).integers(5, eng.cfg.vocab_size, 7).tolist()
    r2 = _run(loop, [Request(prompt=turn2, max_tokens=N)])[0]
  finally:
    loop.close()
  assert r1.cached == 0 and r2.cached == len(r1.fed)  # everything the first turn's cache held
  # the reused rows and state came from decode steps, a full prefill computes them in one call
  agree_up_to_a_tie(eng, turn2, r2.tokens, 2 * ATOL)


def test_a_cancelled_request_frees_its_slot(smol):
  loop = EngineLoop(smol, max_batch=1, max_queue=4)
  try:
    seen = []
    long = Request(prompt=smol.encode_prompt(PROMPTS[0]), max_tokens=100)
    long.listener = lambda r: seen.append(len(r.tokens)) or (len(r.tokens) == 3 and
                                                             loop.cancel(r))
    short = Request(prompt=smol.encode_prompt(PROMPTS[1]), max_tokens=4)
    _run(loop, [long, short])
  finally:
    loop.close()
  assert long.finish_reason == "cancelled" and len(long.tokens) <= 4
  assert short.finish_reason == "length" and short.tokens == _alone(smol, short.prompt, 4)


def test_requests_ended_while_the_next_program_runs(smol):
  """The loop sends a decode program before reading the one before it (run ahead): a request
  ended there by a stop string keeps the tokens up to its stop and nothing sampled after it,
  the other request decoding beside it keeps the solo greedy tokens, and a request that takes
  the freed slot afterwards gets its own solo greedy tokens."""
  eng = smol
  long = _alone(eng, eng.encode_prompt(PROMPTS[0]), 40)
  text = eng.tokenizer.decode(long)
  cut = len(eng.tokenizer.decode(long[:12]))  # a stop string that ends the text at token ~12
  stop = text[cut - 3:cut]
  assert stop and text.find(stop) == cut - 3
  loop = EngineLoop(eng, max_batch=2, max_queue=4)
  ahead = []
  dispatch = loop.session.dispatch
  loop.session.dispatch = lambda *a, **k: ahead.append(k.get("ahead", False)) or dispatch(*a, **k)
  try:
    stopped, beside = _run(loop, [
        Request(prompt=eng.encode_prompt(PROMPTS[0]), max_tokens=40, stop=(stop,),
                decoder=eng.tokenizer.stream_decoder()),
        Request(prompt=eng.encode_prompt(PROMPTS[1]), max_tokens=30)])
    after = _run(loop, [Request(prompt=eng.encode_prompt(PROMPTS[2]), max_tokens=N)])[0]
  finally:
    loop.close()
  assert any(ahead)
  assert stopped.finish_reason == "stop" and stopped.text == text[:cut - 3]
  assert stopped.tokens == long[:len(stopped.tokens)] and len(stopped.tokens) < 40
  assert beside.tokens == _alone(eng, beside.prompt, 30)
  assert after.tokens == _alone(eng, after.prompt, N)
