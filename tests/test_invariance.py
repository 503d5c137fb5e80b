"""A request's answer does not depend on how it was scheduled (docs/NUMERICS.md, "The same answer
however it was scheduled"): the same greedy (and seeded) tokens alone, in a batch of 8, after a
prefix-cache hit or a cold prefill, and through Engine.generate (the CLI's and the API's path)
or the server's engine loop; on the default model and a tiny hybrid Gated-DeltaNet MoE file.

The exact-repeat case is the one a user saw: "Write a haiku about autumn." asked twice at
temperature 0, the second time found in the prefix cache (all but its last token reused, the
last prefilled alone), answered differently from token 21 on, because a one-token call took
llama.cpp's decode products for attention and a prompt's took its batched products."""

import numpy as np
import pytest

from jaxvt import SamplingParams
from jaxvt.prefix import PrefixCache
from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.scheduler import Request
from test_serve_fixtures import hybrid, smol  # noqa: F401  (fixtures)

HAIKU = "Write a haiku about autumn."
PROMPTS = [HAIKU, "Explain photosynthesis in one sentence.", "What is the capital of France?",
           "Tell me a joke about cats.", "List three prime numbers.", "Hi", "def fib(n):",
           "Translate 'good morning' into French."]
SMOL_VOCAB = 49152  # the default model's vocabulary (jaxvt.synth's files have a few hundred)
SEEDED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=77)


def _ids(eng, i: int) -> list[int]:
  """The i-th prompt: a chat prompt of the default model, random ids for the synthetic file."""
  if eng.cfg.vocab_size == SMOL_VOCAB:
    return eng.encode_prompt(PROMPTS[i], chat=True)
  return np.random.default_rng(i).integers(5, eng.cfg.vocab_size, 9 + 5 * i).tolist()


def _serve(eng, prompts, max_tokens: int, prefix: bool = True, max_batch: int = 8, **kw):
  """Requests submitted together to one engine loop; (their tokens, their cached counts)."""
  loop = EngineLoop(eng, max_batch=max_batch, max_queue=16,
                    prefix=PrefixCache(eng, 1 << 30) if prefix else None)
  try:
    out = []
    for group in prompts:  # each group submitted together, after the previous one finished
      reqs = [Request(prompt=list(p), max_tokens=max_tokens,
                      eos_ids=frozenset(eng.tokenizer.stop_ids), **kw) for p in group]
      events = [loop.submit(r) for r in reqs]
      assert all(ev.wait(300) for ev in events)
      out.append([(r.tokens, r.cached) for r in reqs])
    return out
  finally:
    assert loop.close()


def test_exact_repeat_through_the_prefix_cache(smol):
  """The reported case: the same request twice at temperature 0, the second from the prefix
  cache (every prompt token but the last reused)."""
  ids = _ids(smol, 0)
  (first,), (second,) = _serve(smol, [[ids], [ids]], max_tokens=48)
  assert first[1] == 0 and second[1] == len(ids) - 1
  assert second[0] == first[0]


@pytest.mark.parametrize("which", ["smol", "hybrid"])
def test_prefill_in_pieces_gives_the_cold_prefills_bits(which, request):
  """A prompt prefilled from a stored prefix of any length (1, a few, all but its last token)
  gives the logits of one cold prefill, bit for bit."""
  eng = request.getfixturevalue(which)
  for i in range(len(PROMPTS)):
    ids = _ids(eng, i)
    cold = np.asarray(eng.prefill(ids)[0])
    for cut in (1, len(ids) // 2, len(ids) - 1):
      _, cache = eng.prefill(ids[:cut])
      np.testing.assert_array_equal(np.asarray(eng.prefill(ids[cut:], cache, start=cut)[0]),
                                    cold, err_msg=f"prompt {i}, cut at {cut}")


@pytest.mark.parametrize("which", ["smol", "hybrid"])
def test_generate_and_server_give_the_same_tokens(which, request):
  """Engine.generate (jaxvt.run's and the Python API's path) and the server's slots: the same
  greedy tokens and, for a seeded sampled request, the same draws."""
  eng = request.getfixturevalue(which)
  ids = _ids(eng, 0)
  for kw in ({}, SEEDED):
    kw = dict(kw)
    seed = kw.pop("seed", 0)
    gen = eng.generate(ids, max_tokens=24, sampling=SamplingParams(**kw), seed=seed)
    ((served, _),), = _serve(eng, [[ids]], max_tokens=24, seed=seed, **kw)
    assert gen.tokens == served[:len(gen.tokens)] and len(gen.tokens) == len(served), kw


@pytest.mark.parametrize("which", ["smol", "hybrid"])
def test_eight_concurrent_requests_equal_their_solo_answers(which, request):
  """8 requests at once in a server with 8 slots (decode batches of 8 down to 1 as they end)
  against each alone in a fresh server; greedy and seeded."""
  eng = request.getfixturevalue(which)
  prompts = [_ids(eng, i) for i in range(8)]
  for kw in ({}, SEEDED):
    solo = [_serve(eng, [[p]], max_tokens=20, prefix=False, **kw)[0][0][0] for p in prompts]
    (together,) = _serve(eng, [prompts], max_tokens=20, **kw)
    assert [t for t, _ in together] == solo, kw


@pytest.mark.parametrize("which", ["smol", "hybrid"])
def test_next_turn_from_the_prefix_cache_equals_a_cold_run(which, request):
  """A conversation's next turn (its first turn's prompt and answer reused from the prefix
  cache, state written by decode) against the same prompt in a server that never saw it."""
  eng = request.getfixturevalue(which)
  ids = _ids(eng, 2)
  (((answer, _),),) = _serve(eng, [[ids]], max_tokens=12)
  turn = ids + answer[:-1] + _ids(eng, 5)
  (_, (hit,)) = _serve(eng, [[ids], [turn]], max_tokens=16)
  ((cold,),) = _serve(eng, [[turn]], max_tokens=16, prefix=False)
  assert hit[1] > len(ids) // 2 and hit[0] == cold[0]


def test_a_context_that_is_no_multiple_of_8_keeps_one_recipe():
  """--max-context 300: a prompt's last token at position 251 prefilled alone reads a kv_len
  past 256 (the cache's length, rounded up to 304), a cold prefill of the prompt reads 256; the
  attention kernel takes both (a kv_len it could not take would fall back to the jnp formula)."""
  import jaxvt
  with jaxvt.load(max_context=300) as eng:
    assert eng.kv_len(267) % 8 == 0 and eng.kv_len(1) == 256
    ids = (_ids(eng, 1) * 40)[:252]
    cold = np.asarray(eng.prefill(ids)[0])
    _, cache = eng.prefill(ids[:-1])
    np.testing.assert_array_equal(np.asarray(eng.prefill(ids[-1:], cache, start=251)[0]), cold)
