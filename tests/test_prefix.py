"""Prompt reuse (jaxvt.prefix): the logits after a prefill that starts from a stored prefix equal a
full prefill's, for an attention-only model (the default SmolLM2) and for a hybrid
Gated-DeltaNet MoE file (recurrent-state snapshots); and the store's bookkeeping (what is
reusable, merging, LRU eviction within the byte budget)."""

import numpy as np
import pytest

from jaxvt.prefix import PrefixCache
from test_serve_fixtures import ATOL, hybrid, smol  # noqa: F401  (fixtures)


def _tokens(eng, n, seed):
  return np.random.default_rng(seed).integers(10, eng.cfg.vocab_size, n).tolist()


def _full(eng, tokens):
  return np.asarray(eng.prefill(tokens)[0])


@pytest.mark.parametrize("which", ["smol", "hybrid"])
def test_second_turn_reuses_the_first_and_equals_a_full_prefill(which, request):
  eng = request.getfixturevalue(which)
  pc = PrefixCache(eng, budget_bytes=1 << 30, interval=16)
  turn1 = _tokens(eng, 40, 1)
  turn2 = turn1 + _tokens(eng, 13, 2)
  logits1, _, cached1 = pc.prefill(turn1)
  assert cached1 == 0
  np.testing.assert_allclose(np.asarray(logits1), _full(eng, turn1), rtol=0, atol=ATOL)
  logits2, cache2, cached2 = pc.prefill(turn2)
  assert cached2 == 40  # the whole first turn: its end is a stored state
  np.testing.assert_allclose(np.asarray(logits2), _full(eng, turn2), rtol=ATOL, atol=ATOL)
  # decoding on from the reused cache follows the full prefill's cache too
  nxt = int(np.argmax(np.asarray(logits2)))
  after, _ = eng.decode_step(cache2, nxt, len(turn2))
  _, full_cache = eng.prefill(turn2)
  want, _ = eng.decode_step(full_cache, nxt, len(turn2))
  np.testing.assert_allclose(np.asarray(after), np.asarray(want), rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("which", ["smol", "hybrid"])
def test_a_diverging_prompt_reuses_up_to_a_snapshot(which, request):
  """Attention layers can reuse any common prefix; a hybrid model only up to the last recurrent
  snapshot at or before it (every `interval` tokens of a prefill)."""
  eng = request.getfixturevalue(which)
  pc = PrefixCache(eng, budget_bytes=1 << 30, interval=16)
  a = _tokens(eng, 50, 3)
  pc.prefill(a)
  b = a[:37] + _tokens(eng, 9, 4)
  logits, _, cached = pc.prefill(b)
  assert cached == (37 if which == "smol" else 32)
  np.testing.assert_allclose(np.asarray(logits), _full(eng, b), rtol=ATOL, atol=ATOL)
  # the same prompt again: all but its last token (whose logits are wanted) come from the store;
  # for the hybrid model, up to the last snapshot before that token
  logits, _, cached = pc.prefill(b)
  assert cached == (len(b) - 1 if which == "smol" else 32)
  np.testing.assert_allclose(np.asarray(logits), _full(eng, b), rtol=ATOL, atol=ATOL)


def test_store_merges_extensions_and_evicts_least_recently_used(smol):
  pc = PrefixCache(smol, budget_bytes=1 << 30)
  a = _tokens(smol, 30, 5)
  pc.prefill(a)
  pc.prefill(a + _tokens(smol, 5, 6))  # extends a: one entry holds both
  assert len(pc) == 1
  one = pc.nbytes
  pc.budget_bytes = 2 * one
  b, c = _tokens(smol, 30, 7), _tokens(smol, 30, 8)
  pc.prefill(b)
  assert len(pc) == 2
  pc.lookup(a + [1, 2])  # a's entry is now the most recently used
  pc.prefill(c)  # over budget: b (least recently used) goes
  assert len(pc) == 2 and pc.nbytes <= pc.budget_bytes
  assert pc.lookup(b + [1])[0] == 0 and pc.lookup(a + [1])[0] == len(a)


def test_no_budget_stores_nothing(hybrid):
  pc = PrefixCache(hybrid, budget_bytes=0)
  t = _tokens(hybrid, 20, 9)
  pc.prefill(t)
  assert len(pc) == 0 and pc.prefill(t)[2] == 0
