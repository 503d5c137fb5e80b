"""Token sampling: greedy, temperature, top-k, top-p (nucleus), as pure jittable functions; and
what a generation returns (Generation, GenerationStats: jaxvt.engine.Engine.generate)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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


@dataclasses.dataclass
class GenerationStats:
  """What a generate call did. The rates are steady-state: compiling the programs new to this
  engine (prefill's before it runs, each decode program when first needed) is
  `compile_seconds`, counted apart."""
  prompt_tokens: int = 0
  generated_tokens: int = 0
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0
  compile_seconds: float = 0.0
  decode_steps: int = 0  # steps the device ran (a chunk runs on past a stop token)

  @property
  def prefill_tok_s(self) -> float:
    return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

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
