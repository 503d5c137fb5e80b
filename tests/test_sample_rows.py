"""sample_rows (each row its own temperature, top-k, top-p and seed) against a float64 numpy
reference of the distribution it must draw from."""

import jax
import numpy as np
import pytest

from jaxvt.sampling import SamplingParams, sample, sample_rows, seed_words, token_logprobs

V = 12


def _reference(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
  """The probabilities after the temperature, the top-k cut and the nucleus cut, in float64."""
  x = logits.astype(np.float64) / t
  V = x.shape[-1]
  order = np.argsort(-x, kind="stable")
  keep = np.zeros(V, bool)
  keep[order[:k or V]] = True
  probs = np.where(keep, np.exp(x - x.max()), 0.0)
  probs /= probs.sum()
  mass, nucleus = 0.0, np.zeros(V, bool)
  for i in order:
    if not keep[i] or mass >= p:
      break
    nucleus[i] = True
    mass += probs[i]
  out = np.where(nucleus, probs, 0.0)
  return out / out.sum()


def _draw(logits, rows, n):
  """n draws of each row: rows is a list of (temperature, top_k, top_p, seed)."""
  b = len(rows)
  t = np.asarray([r[0] for r in rows], np.float32)
  k = np.asarray([r[1] for r in rows], np.int32)
  p = np.asarray([r[2] for r in rows], np.float32)
  seeds = np.asarray([seed_words(r[3]) for r in rows], np.uint32)
  draw = jax.jit(jax.vmap(lambda c: sample_rows(logits, seeds, jax.numpy.full(b, c, np.int32), t, k, p)))
  return np.asarray(draw(np.arange(n, dtype=np.int32)))  # [n, b]


def test_each_row_draws_from_its_own_distribution():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2, (4, V)).astype(np.float32)
  rows = [(1.0, 0, 1.0, 1), (0.7, 3, 1.0, 2), (1.3, 0, 0.6, 3), (0.0, 0, 1.0, 4)]
  n = 4000
  got = _draw(logits, rows, n)
  for i, (t, k, p, _) in enumerate(rows):
    if t == 0:
      assert (got[:, i] == np.argmax(logits[i])).all()
      continue
    want = _reference(logits[i], t, k, p)
    freq = np.bincount(got[:, i], minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))  # never outside the cut
    # within 5 standard errors of each probability
    assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9), (i, freq, want)


def test_a_rows_draws_depend_on_its_seed_and_counter_only():
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 1, (3, V)).astype(np.float32)
  alone = _draw(logits[:1], [(1.0, 0, 1.0, 99)], 50)[:, 0]
  together = _draw(logits, [(1.0, 0, 1.0, 99), (0.5, 2, 1.0, 5), (2.0, 0, 0.9, 7)], 50)[:, 0]
  assert (alone == together).all()
  other = _draw(logits[:1], [(1.0, 0, 1.0, 100)], 50)[:, 0]
  assert (other != alone).any()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, 5, 0.9)])
def test_greedy_and_cuts_match_sample(params):
  """With one row, sample_rows keeps exactly the tokens `sample` keeps (greedy: the same one)."""
  rng = np.random.default_rng(2)
  logits = rng.normal(0, 3, (1, 400)).astype(np.float32)
  key = jax.random.key(3)
  ours = set(_draw(logits, [(params.temperature, params.top_k, params.top_p, 3)], 300)[:, 0])
  theirs = {int(sample(logits, k, params)[0]) for k in jax.random.split(key, 300)}
  if params.greedy:
    assert ours == theirs == {int(np.argmax(logits))}
  else:
    assert ours <= set(np.flatnonzero(_reference(logits[0], 0.8, 5, 0.9)))
    assert theirs <= set(np.flatnonzero(_reference(logits[0], 0.8, 5, 0.9)))


def test_logit_bias_moves_the_choice():
  rng = np.random.default_rng(4)
  logits = rng.normal(0, 1, (2, V)).astype(np.float32)
  top = np.argmax(logits, -1)
  bias = np.zeros((2, V), np.float32)
  bias[0, top[0]] = -100.0
  z = np.zeros(2, np.float32)
  got = np.asarray(sample_rows(logits, np.zeros((2, 2), np.uint32), np.zeros(2, np.int32), z,
                               np.zeros(2, np.int32), np.ones(2, np.float32), bias))
  assert got[0] == np.argsort(-logits[0])[1] and got[1] == top[1]


def _penalized(logits, counts, freq, pres):
  """OpenAI's penalties in float64: logit - freq * count - pres * (count > 0)."""
  c = counts.astype(np.float64)
  return logits.astype(np.float64) - freq * c - pres * (c > 0)


def test_penalties_match_the_float64_reference():
  """Greedy rows take the argmax of the penalized logits; sampled rows draw from the penalized
  distribution; each row with its own counts and penalties (one row unpenalized)."""
  rng = np.random.default_rng(5)
  b = 4
  logits = rng.normal(0, 1, (b, V)).astype(np.float32)
  counts = rng.integers(0, 3, (b, V)).astype(np.int32)
  counts[:, np.argmax(logits, -1)] = 2  # the unpenalized best is penalized in every row
  freq = np.asarray([0.8, -0.5, 0.0, 1.7], np.float32)
  pres = np.asarray([0.6, 1.0, 0.0, -2.0], np.float32)
  want = [_penalized(logits[i], counts[i], freq[i], pres[i]) for i in range(b)]
  z, ones = np.zeros(b, np.float32), np.ones(b, np.float32)
  seeds, zk = np.zeros((b, 2), np.uint32), np.zeros(b, np.int32)
  greedy = np.asarray(sample_rows(logits, seeds, zk, z, zk, ones, None, (counts, freq, pres)))
  assert greedy.tolist() == [int(np.argmax(w)) for w in want]
  assert greedy[2] == np.argmax(logits[2])  # no penalty: the raw argmax
  assert (greedy[[0, 1]] != np.argmax(logits[[0, 1]], -1)).any()  # the penalties changed picks
  n = 4000
  seeds = np.asarray([seed_words(s) for s in range(b)], np.uint32)
  draw = jax.jit(jax.vmap(lambda c: sample_rows(logits, seeds, jax.numpy.full(b, c, np.int32),
                                                ones, zk, ones, None, (counts, freq, pres))))
  got = np.asarray(draw(np.arange(n, dtype=np.int32)))
  for i in range(b):
    p = np.exp(want[i] - want[i].max())
    p /= p.sum()
    freq_i = np.bincount(got[:, i], minlength=V) / n
    assert np.all(np.abs(freq_i - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9), (i, freq_i, p)


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits():
  rng = np.random.default_rng(6)
  logits = rng.normal(0, 4, (3, 300)).astype(np.float32)
  toks = np.asarray([5, 17, 299], np.int32)
  lp, ids, top = (np.asarray(a) for a in token_logprobs(logits, toks, 20))
  x = logits.astype(np.float64)
  ref = x - x.max(-1, keepdims=True)
  ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
  np.testing.assert_allclose(lp, ref[np.arange(3), toks], atol=1e-5)
  np.testing.assert_array_equal(ids, np.argsort(-ref, -1, kind="stable")[:, :20])
  np.testing.assert_allclose(top, np.take_along_axis(ref, ids, -1), atol=1e-5)


def nucleus_inputs(rng, n: int, vocab: int):
  """Logits with a long, flat tail (the nucleus' sums then cover many tokens) and per-row
  parameters that all sample."""
  logits = (rng.standard_normal((n, vocab)) * 3.0).astype(np.float32)
  seeds = np.stack([np.arange(n, dtype=np.uint32) * 7 + 1, np.full(n, 3, np.uint32)], axis=1)
  return (logits, seeds, np.arange(n, dtype=np.int32), np.full(n, 0.9, np.float32),
          np.zeros(n, np.int32), np.linspace(0.5, 0.99, n).astype(np.float32))


def test_a_rows_draw_and_sums_do_not_depend_on_the_other_rows():
  """A row's nucleus sums (row_softmax, row_cumsum) and its sampled token are the same bits alone
  and among 32 rows; the sums are float64 numpy's to float32 rounding."""
  from jaxvt.sampling import row_cumsum, row_softmax
  rng = np.random.default_rng(5)
  logits, seeds, counters, temp, top_k, top_p = nucleus_inputs(rng, 32, 12289)
  many = np.asarray(sample_rows(logits, seeds, counters, temp, top_k, top_p))
  soft, cums = np.asarray(row_softmax(logits)), np.asarray(row_cumsum(logits))
  for i in (0, 17, 31):
    one = slice(i, i + 1)
    assert int(sample_rows(logits[one], seeds[one], counters[one], temp[one], top_k[one],
                           top_p[one])[0]) == many[i]
    assert np.array_equal(np.asarray(row_softmax(logits[one]))[0].view(np.uint32),
                          soft[i].view(np.uint32))
    assert np.array_equal(np.asarray(row_cumsum(logits[one]))[0].view(np.uint32),
                          cums[i].view(np.uint32))
  x = logits[:4].astype(np.float64)
  want = np.exp(x - x.max(-1, keepdims=True))
  np.testing.assert_allclose(soft[:4], want / want.sum(-1, keepdims=True), rtol=2e-5, atol=1e-12)
  np.testing.assert_allclose(cums[:4], np.cumsum(x, axis=-1), rtol=1e-4, atol=2e-2)
