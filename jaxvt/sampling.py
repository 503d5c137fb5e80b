"""Token sampling: greedy, temperature, top-k, top-p (nucleus), as pure jittable functions (one
set of parameters for every row: `sample`; each row its own, as a server's batch needs:
`sample_rows`, with OpenAI's logit bias and frequency/presence penalties: `adjust_logits`); the
log-probabilities a server reports (`token_logprobs`); and what a generation returns
(Generation, GenerationStats: jaxvt.engine.Engine.generate)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import inputs


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Checked when built (jaxvt.inputs.sampling): a value out of range is a JaxvtError here,
  never a NaN or an XLA error at the first step."""
  temperature: float = 0.0  # 0: greedy (argmax)
  top_k: int = 0  # 0: no top-k cut (a k at or above the vocabulary is the same: see Engine)
  top_p: float = 1.0  # 1: no nucleus cut

  def __post_init__(self):
    t, k, p = inputs.sampling(self.temperature, self.top_k, self.top_p)
    object.__setattr__(self, "temperature", t)
    object.__setattr__(self, "top_k", k)
    object.__setattr__(self, "top_p", p)

  @property
  def greedy(self) -> bool:
    return self.temperature <= 0.0


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """logits float32 [b, vocab] -> token ids int32 [b]. `params` is static."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = logits.astype(jnp.float32) / params.temperature
  if params.top_k > 0:
    kth = jax.lax.top_k(x, params.top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if params.top_p < 1.0:
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_x, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    keep_sorted = jnp.cumsum(probs, axis=-1) - probs < params.top_p
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, -jnp.inf, x)
  return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


TOP_LOGPROBS = 20  # alternatives token_logprobs returns per row (OpenAI's top_logprobs limit)


def penalize(logits: jax.Array, counts: jax.Array, frequency: jax.Array,
             presence: jax.Array) -> jax.Array:
  """OpenAI's frequency and presence penalties: logits float32 [b, vocab] less
  frequency[b] * counts[b, v] + presence[b] * (counts[b, v] > 0). counts int32 [b, vocab]: how
  many times each token was generated so far in the row; as OpenAI's, only generated tokens
  count, never the prompt's."""
  c = counts.astype(jnp.float32)
  return (logits.astype(jnp.float32) - frequency[:, None] * c
          - presence[:, None] * (c > 0).astype(jnp.float32))


def adjust_logits(logits: jax.Array, bias: jax.Array | None = None,
                  penalties: tuple | None = None) -> jax.Array:
  """The logits sampling draws from: `bias` float32 [b, vocab] (OpenAI's logit_bias) added, then
  `penalties` (counts, frequency, presence: `penalize`'s arguments) taken off; None: none."""
  if bias is not None:
    logits = logits.astype(jnp.float32) + bias
  if penalties is not None:
    logits = penalize(logits, *penalties)
  return logits


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int = TOP_LOGPROBS):
  """The log-softmax of `logits` float32 [b, vocab] (the model's own, before bias, penalties,
  temperature and cuts) at `tokens` int32 [b], and its `k` largest entries: (float32 [b], ids
  int32 [b, k], float32 [b, k]); ties keep the lower token id first."""
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  top, ids = jax.lax.top_k(lp, k)
  return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], ids.astype(jnp.int32), top


def row_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis, keepdims, in one fixed tree of pairwise adds (the axis zero-padded
  to a power of two, then halved until one is left): a row's sum is the same bits whatever else
  the array holds. (XLA's reductions pick their order by the array's shape, so a row alone and
  the same row among others may round apart.)"""
  n = x.shape[-1]
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << max(0, (n - 1).bit_length())) - n)])
  while x.shape[-1] > 1:
    h = x.shape[-1] // 2
    x = x[..., :h] + x[..., h:]
  return x


def row_softmax(x: jax.Array) -> jax.Array:
  """softmax over the last axis with row_sum's normaliser (the max is exact in any order)."""
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / row_sum(e)


def row_cumsum(x: jax.Array) -> jax.Array:
  """Inclusive prefix sums over the last axis: jnp.cumsum, a reduce-window that XLA rewrites into
  blocked scans by the axis' length alone, so a row's sums do not depend on the other rows
  (tests/test_sample_rows.py and, on a GPU, tests/test_batch_invariance_gpu.py check it).
  jax.lax.associative_scan would fix the pairing too, at about a second more of compile a
  program on the CPU."""
  return jnp.cumsum(x, axis=-1)


@jax.jit
def sample_rows(logits: jax.Array, seeds: jax.Array, counters: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array, bias: jax.Array | None = None,
                penalties: tuple | None = None) -> jax.Array:
  """Each row sampled with its own parameters: logits float32 [b, vocab]; seeds uint32 [b, 2]
  (a 64-bit seed as low and high words) and counters int32 [b] (the row's token index: the key
  is the seed's folded with it, so a row's draws do not depend on the other rows); temperature
  float32 [b] (0: greedy, the argmax), top_k int32 [b] (0: off), top_p float32 [b] (1: off).
  `bias` and `penalties` (adjust_logits) change the logits first, greedy rows' as well.
  Returns token ids int32 [b]. The cuts are `sample`'s: top-k first, then the smallest
  most-likely prefix whose mass reaches top_p (at least one token). A row's draw does not depend
  on the other rows: the nucleus' sums run in orders of their own (row_softmax, row_cumsum), the
  rest is exact (sorts, maxima, the Gumbel draw's argmax)."""
  vocab = logits.shape[-1]
  logits = adjust_logits(logits, bias, penalties)
  hot = temperature > 0
  x = logits.astype(jnp.float32) / jnp.where(hot, temperature, 1.0)[:, None]
  desc = jnp.sort(x, axis=-1)[:, ::-1]
  k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
  kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
  x = jnp.where(x < kth, -jnp.inf, x)
  desc = jnp.where(desc < kth, -jnp.inf, desc)
  probs = row_softmax(desc)
  keep = (row_cumsum(probs) - probs < top_p[:, None]) | (top_p[:, None] >= 1.0)
  cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
  x = jnp.where(x < cutoff, -jnp.inf, x)

  def draw(seed, counter, row):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), counter)
    return jax.random.categorical(key, row)

  drawn = jax.vmap(draw)(seeds, counters, x)
  return jnp.where(hot, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)

def mask_words(vocab: int) -> int:
  """int32 words of a packed token mask over `vocab` tokens (apply_mask)."""
  return (vocab + 31) // 32


def pack_mask(allowed: np.ndarray) -> np.ndarray:
  """bool [..., vocab] -> the packed int32 [..., ceil(vocab / 32)] mask (little-endian bits)."""
  v = allowed.shape[-1]
  pad = np.zeros(allowed.shape[:-1] + (mask_words(v) * 32 - v,), bool)
  bits = np.packbits(np.concatenate([allowed, pad], -1), axis=-1, bitorder="little")
  return bits.view(np.int32)


def apply_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """logits float [b, vocab] with disallowed tokens at -inf; mask int32 [b, ceil(vocab / 32)]
  (a row of all ones bits, -1, leaves its row as it is). Jittable: the expansion runs on the
  device, so a step moves vocab / 8 bytes a row instead of a float bias's 4 * vocab."""
  vocab = logits.shape[-1]
  # each word's 32 bits side by side (a broadcast, not a gather), then cut to the vocabulary
  bits = (mask[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1
  bits = bits.reshape(*mask.shape[:-1], mask.shape[-1] * 32)[..., :vocab]
  return jnp.where(bits != 0, logits, -jnp.inf)


def row_key(seed: int, params: SamplingParams) -> dict:
  """The sampling state of one sequence that generate's programs carry (first_token_fn,
  decode_loop_fn) in place of a PRNG key: sample_rows' row arguments for `seed` and `params`
  and the index of the next token. Its draws are the server's for a request with the same seed
  and parameters (jaxvt.serve.batch.row_args): one sampling path for the CLI, the API and the
  server. Arrays, not constants, so that the temperature divides as in the server's program
  (XLA would turn a division by a constant into a product)."""
  return {"seed": np.asarray(seed_words(seed), np.uint32), "index": np.int32(0),
          "temperature": np.float32(params.temperature), "top_k": np.int32(params.top_k),
          "top_p": np.float32(params.top_p)}


def sample_keyed(logits: jax.Array, key: dict, greedy: bool) -> tuple[jax.Array, dict]:
  """logits float32 [b, vocab] -> (token ids int32 [b], `key` at the next token index): every
  row drawn by sample_rows with `key`'s arguments (row_key); `greedy` (static): the argmax,
  which is sample_rows' answer at temperature 0, without its sort."""
  b = logits.shape[0]
  if greedy:
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    row = lambda x: jnp.broadcast_to(x, (b,))
    tok = sample_rows(logits, jnp.broadcast_to(key["seed"], (b, 2)), row(key["index"]),
                      row(key["temperature"]), row(key["top_k"]), row(key["top_p"]))
  return tok, {**key, "index": key["index"] + 1}


def seed_words(seed: int) -> tuple[int, int]:
  """A 64-bit seed (any Python int in the signed 64-bit range) as sample_rows' two uint32 words."""
  u = seed & (2**64 - 1)
  return u & 0xFFFFFFFF, u >> 32


@dataclasses.dataclass
class GenerationStats:
  """What a generate call did. The rates are steady-state: compiling the programs new to this
  engine (prefill's before it runs, each decode program when first needed) is
  `compile_seconds`, counted apart."""
  prompt_tokens: int = 0
  cached_tokens: int = 0  # of the prompt, taken from a prefix cache instead of prefilled
  generated_tokens: int = 0
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0
  compile_seconds: float = 0.0
  decode_steps: int = 0  # steps the device ran (a chunk runs on past a stop token)

  @property
  def prefill_tok_s(self) -> float:
    n = self.prompt_tokens - self.cached_tokens  # the tokens prefill computed
    return n / self.prefill_seconds if self.prefill_seconds else 0.0

  @property
  def decode_tok_s(self) -> float:
    # the first generated token comes from prefill; decode produced the rest
    n = max(self.generated_tokens - 1, 0)
    return n / self.decode_seconds if self.decode_seconds else 0.0


@dataclasses.dataclass
class Generation:
  tokens: list[int]
  text: str
  stats: GenerationStats
  stopped_by: str  # "eos" | "max_tokens" | "context"
