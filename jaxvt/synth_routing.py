"""Routing-realistic synthetic MoE models: the statistics of a decode's expert choices, a model of
how topic-structured weights produce them, and the weights that realise it (jaxvt.synth writes
them when `write_model(..., routing=RoutingStats(...))`).

The statistics of a trace `ids` int [T, L, k] (the k experts each of L MoE layers chose for each
of T consecutive decode tokens) out of E experts:

- reuse within w: the fraction of token t's chosen experts (at a layer) that one of the w tokens
  before it (t-w .. t-1) chose at that layer, over t >= w: the hit rate of a per-layer cache
  holding the experts of the last w tokens. w = 1 is next-token reuse. Memoryless uniform
  routing gives k/E at w = 1 and about 1 - (1 - k/E)^w.
- skew: the share of all selections at a layer taken by its ceil(E/10) most chosen experts over
  the trace (uniform routing: 0.1 plus the sampling noise of T*k selections).
- next-layer predictability: how well layer l's choice predicts layer l+1's. The predictor is
  fitted on the first half of the trace: C[i, j] counts the tokens that chose expert i at l and
  j at l+1; for a token of the second half it names the k experts j with the largest
  sum_{i in S_l} C[i, j]; the score is the fraction of layer l+1's actual choice it names
  (uniform routing: about k/E, more where tokens repeat exactly).

How routing-realistic weights produce them. Router logits are the router's rows dotted with the
MoE input (the normed residual), so routing follows whatever dominates that residual. The file's
embedding makes the residual large next to what the blocks add (rows of per-element rms
EMBED_RMS_PER_LAYER * sqrt(n_layers)), so each layer's MoE input is close to the current token's
normed embedding:

  e_v = R (cos(phi) u_c(v) + sin(phi) g_v)     u_c: C orthonormal "topic" directions; every
                                               token belongs to one topic c(v); g_v: a unit
                                               vector orthogonal to all u (the token's own part)
  router_l[e] = sum_c P_l[c, e] u_c / (sqrt(d) cos(phi)) + N_l[e]
      P_l = theta z_l + beta b_l               z_l [C, E], b_l [E]: N(0, 1) (topic preference,
                                               and a popularity shared by every topic)
      N_l[e]: N(0, 1/(d sin^2 phi)) per element, orthogonal to the u; N_{l+1}[pi_l(e)] =
              rho N_l[e] + sqrt(1 - rho^2) fresh (pi_l a random permutation)
  output[v] = gamma u_c(v) + small noise       a token's topic is favoured by `delta` logits

so that layer l's logits for token v are theta z_l[c(v)] + beta b_l + xi_l[v] with xi_l[v]
~ N(0, 1) per expert (the token's part; correlated rho across layers through pi_l). A decode at
temperature 1 stays in the current topic with probability `stay` (the head's `delta` is chosen
for it) and otherwise jumps to another topic. Topic persistence gives temporal reuse; few topics
give reuse within a window and skew; `beta` adds popularity; `rho` adds token-level cross-layer
predictability on top of the topic's. `calibrate` picks (topics, stay, theta, beta, rho) for
target statistics by simulating this process (`simulate`) with the model's E, k and vocabulary;
`benchmarks.routing` measures the real decode of the written file.

What this costs in realism: the blocks (attention, Gated DeltaNet, experts) all run, but they
barely move the residual, so the routing is a function of the token and its topic alone; the
statistics are those of one decode (tokens repeat, few topics are visited), so a real decode
lands near the targets, not on them (docs/BENCHMARKS.md, "routing"). Targets interact: with
256 experts of which 8 are used, reuse of 0.45 / 0.80 needs so few topics that the top 10% of
experts take about 85% of the selections.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PHI = math.pi / 4  # topic vs token share of the embedding
EMBED_RMS_PER_LAYER = 8.0  # embedding element rms / sqrt(n_layers): the blocks add little
HEAD_NOISE = 0.5  # logit std of the output rows' own random part
_TOPIC_CHOICES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
_SIM_VOCAB = 4096  # simulated tokens at most (repeats of one token are rare beyond this)
_SIM_SEQS = 4  # sequences averaged per simulated statistic


@dataclasses.dataclass(frozen=True)
class RoutingStats:
  """Target statistics of a decode's expert choices (see the module docstring for each), as a
  decode of `tokens` tokens at temperature 1 measures them (`benchmarks.routing`). The defaults
  of the two reuse figures are those of real Qwen3-30B-A3B routing traces; skew and next-layer
  predictability None: not targeted, the value the topic structure gives (the probe reports it).
  """

  next_token_reuse: float = 0.45
  reuse_within_8: float = 0.80
  skew: float | None = None  # share of selections taken by the top 10% of experts
  next_layer_predictability: float | None = None
  tokens: int = 512  # decode length the statistics are of (skew and predictability depend on it)

  def __post_init__(self):
    for name in ("next_token_reuse", "reuse_within_8", "skew", "next_layer_predictability"):
      v = getattr(self, name)
      if v is not None and not 0.0 < v < 1.0:
        raise ValueError(f"RoutingStats.{name} must lie in (0, 1), got {v}")
    if self.reuse_within_8 < self.next_token_reuse:
      raise ValueError("RoutingStats.reuse_within_8 must be >= next_token_reuse (a window of 8 "
                       "holds the next token's)")
    if self.tokens < 32:
      raise ValueError(f"RoutingStats.tokens must be >= 32, got {self.tokens}")

  def targets(self) -> dict[str, float]:
    """{statistic name: target} of the targeted statistics."""
    out = {"next_token_reuse": self.next_token_reuse, "reuse_within_8": self.reuse_within_8,
           "skew": self.skew, "next_layer_predictability": self.next_layer_predictability}
    return {k: v for k, v in out.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Knobs:
  """The construction's parameters (module docstring): topics C, stay probability, topic
  strength theta, popularity beta, cross-layer token correlation rho."""
  topics: int
  stay: float
  theta: float
  beta: float
  rho: float


# ---------------------------------------------------------------------------------------------
# Statistics of a trace.

def _one_hot(ids: np.ndarray, n_experts: int) -> np.ndarray:
  """ids int [T, L, k] -> bool [T, L, E]."""
  oh = np.zeros((*ids.shape[:2], n_experts), bool)
  np.put_along_axis(oh, ids, True, axis=2)
  return oh


def reuse(ids: np.ndarray, n_experts: int, window: int) -> np.ndarray:
  """Per layer [L]: the fraction of each token's experts one of the `window` tokens before it
  chose (tokens t >= window of ids int [T, L, k])."""
  T, _, k = ids.shape
  if T <= window:
    raise ValueError(f"a trace of {T} tokens has no token with {window} before it")
  oh = _one_hot(ids, n_experts)
  seen = np.zeros_like(oh[window:])
  for j in range(1, window + 1):
    seen |= oh[window - j:T - j]
  return (seen & oh[window:]).sum(axis=(0, 2)) / ((T - window) * k)


def skew(ids: np.ndarray, n_experts: int) -> np.ndarray:
  """Per layer [L]: the share of selections taken by the ceil(E/10) most chosen experts."""
  top = max(1, math.ceil(n_experts / 10))
  counts = _one_hot(ids, n_experts).sum(axis=0)  # [L, E]
  return np.sort(counts, axis=1)[:, ::-1][:, :top].sum(axis=1) / counts.sum(axis=1)


def next_layer_predictability(ids: np.ndarray, n_experts: int) -> np.ndarray:
  """Per layer pair [L-1]: the fraction of layer l+1's experts that the co-occurrence predictor
  fitted on the first half names from layer l's, over the second half (module docstring)."""
  T, L, k = ids.shape
  h = T // 2
  oh = _one_hot(ids, n_experts)
  f = oh.astype(np.float32)  # counts: exact in float32
  out = np.zeros(max(L - 1, 0))
  for l in range(L - 1):
    co = f[:h, l].T @ f[:h, l + 1]  # [E, E]
    score = f[h:, l] @ co
    pred = np.argsort(-score, axis=1, kind="stable")[:, :k]  # ties: the lower id first
    out[l] = int(np.take_along_axis(oh[h:, l + 1], pred, axis=1).sum()) / ((T - h) * k)
  return out


def measure(ids: np.ndarray, n_experts: int) -> dict[str, np.ndarray]:
  """{statistic name: per-layer values} of a trace ids int [T, L, k]: next_token_reuse,
  reuse_within_8, skew ([L]) and next_layer_predictability ([L-1])."""
  return {"next_token_reuse": reuse(ids, n_experts, 1),
          "reuse_within_8": reuse(ids, n_experts, 8),
          "skew": skew(ids, n_experts),
          "next_layer_predictability": next_layer_predictability(ids, n_experts)}


# ---------------------------------------------------------------------------------------------
# The process the weights realise, simulated.

def topic_of(n_vocab: int, topics: int, seed: int) -> np.ndarray:
  """int [V]: each token's topic (a fixed random assignment, equal sizes up to one)."""
  return np.random.default_rng([seed, 0x7091C]).permutation(n_vocab) % topics


@dataclasses.dataclass(frozen=True)
class Draws:
  """The random numbers of one simulated sequence, shared by every knob setting (common random
  numbers: the simulated statistics move smoothly with the knobs)."""
  u_jump: np.ndarray  # [T] uniform: the token jumps to another topic where u < 1 - stay
  u_offset: np.ndarray  # [T] uniform: which other topic
  u_member: np.ndarray  # [T] uniform: which token of the topic
  xi: np.ndarray  # [V', E] the tokens' own logits at the first layer (V' = min(V, _SIM_VOCAB))
  fresh: np.ndarray  # [V', E] their fresh part at the second
  perm: np.ndarray  # [E] the second layer's permutation of the experts
  z: np.ndarray  # [2, max topics, E] topic preferences per layer
  b: np.ndarray  # [2, E] popularity per layer

  @classmethod
  def make(cls, n_experts: int, n_vocab: int, tokens: int, seed: int) -> "Draws":
    rng = np.random.default_rng([seed, 0x51])
    V = min(n_vocab, _SIM_VOCAB)
    return cls(rng.random(tokens), rng.random(tokens), rng.random(tokens),
               rng.standard_normal((V, n_experts)), rng.standard_normal((V, n_experts)),
               rng.permutation(n_experts),
               rng.standard_normal((2, max(_TOPIC_CHOICES), n_experts)),
               rng.standard_normal((2, n_experts)))


def simulate(knobs: Knobs, k: int, draws: Draws) -> np.ndarray:
  """A trace int [T, 2, k] (two consecutive layers) of the process the weights realise (module
  docstring), from one sequence's draws."""
  V, E = draws.xi.shape
  C = knobs.topics
  members = -(-V // C)  # tokens of a topic: token = topic + C * member
  jump = draws.u_jump < 1.0 - knobs.stay
  jump[0] = True
  offset = 1 + np.floor(draws.u_offset * (C - 1)).astype(np.int64)
  c = np.cumsum(np.where(jump, offset, 0)) % C
  tok = np.minimum(c + C * np.floor(draws.u_member * members).astype(np.int64), V - 1)
  c = tok % C
  xi = draws.xi[tok]
  ids = np.empty((len(tok), 2, k), np.int64)
  for l in range(2):
    if l:
      moved = knobs.rho * xi + math.sqrt(1 - knobs.rho**2) * draws.fresh[tok]
      xi = np.empty_like(moved)
      xi[:, draws.perm] = moved
    logits = knobs.theta * draws.z[l, c] + knobs.beta * draws.b[l] + xi
    ids[:, l] = np.argpartition(-logits, k - 1, axis=1)[:, :k]
  return ids


def simulated_stats(knobs: Knobs, k: int, draws: list[Draws]) -> dict[str, float]:
  """The statistics of the simulated sequences of `draws`, averaged."""
  E = draws[0].xi.shape[1]
  acc: dict[str, list[float]] = {}
  for d in draws:
    for name, v in measure(simulate(knobs, k, d), E).items():
      acc.setdefault(name, []).append(float(np.mean(v)))
  return {name: float(np.mean(v)) for name, v in acc.items()}


# ---------------------------------------------------------------------------------------------
# Calibration: knobs for target statistics.

def _knobs(x: np.ndarray, topics: int, stats: RoutingStats) -> Knobs:
  """Unconstrained coordinates -> knobs (beta, rho fixed at 0 where their statistic is not
  targeted)."""
  sig = lambda t: 1.0 / (1.0 + math.exp(-t))
  return Knobs(topics=topics, stay=0.02 + 0.97 * sig(x[0]), theta=math.exp(x[1]),
               beta=math.exp(x[2]) if stats.skew is not None else 0.0,
               rho=0.98 * sig(x[3]) if stats.next_layer_predictability is not None else 0.0)


def _nelder_mead(f, x0: np.ndarray, step: float, iters: int) -> tuple[np.ndarray, float]:
  """Minimises f from x0 (a fixed number of iterations: deterministic)."""
  n = len(x0)
  pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
  vals = [f(p) for p in pts]
  for _ in range(iters):
    order = np.argsort(vals, kind="stable")
    pts, vals = [pts[i] for i in order], [vals[i] for i in order]
    centre = np.mean(pts[:-1], axis=0)
    refl = centre + (centre - pts[-1])
    fr = f(refl)
    if fr < vals[0]:
      exp = centre + 2 * (centre - pts[-1])
      fe = f(exp)
      pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
    elif fr < vals[-2]:
      pts[-1], vals[-1] = refl, fr
    else:
      con = centre + 0.5 * (pts[-1] - centre)
      fc = f(con)
      if fc < vals[-1]:
        pts[-1], vals[-1] = con, fc
      else:
        pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
        vals = [vals[0]] + [f(p) for p in pts[1:]]
  i = int(np.argmin(vals))
  return pts[i], vals[i]


def calibrate(stats: RoutingStats, n_experts: int, k: int, n_vocab: int,
              d_model: int) -> tuple[Knobs, dict[str, float]]:
  """Knobs whose simulated statistics come closest to the targets (squared error): a short
  search at each topic count of _TOPIC_CHOICES (at most d_model / 4 topics, which
  Construction needs), continued at the best two. Deterministic; returns (knobs, their
  simulated statistics)."""
  if not 0 < k < n_experts:
    raise ValueError(f"routing needs 0 < experts used < experts, got {k} of {n_experts}")
  targets = stats.targets()
  draws = [Draws.make(n_experts, n_vocab, stats.tokens, s) for s in range(_SIM_SEQS)]

  def loss(x, C):
    got = simulated_stats(_knobs(x, C, stats), k, draws)
    return sum((got[n] - t) ** 2 for n, t in targets.items())

  x0 = np.array([1.0, 0.7, -1.0, 0.0])
  coarse = [(*_nelder_mead(lambda x, C=C: loss(x, C), x0, 1.0, 12), C)
            for C in _TOPIC_CHOICES if C <= min(n_experts, n_vocab, d_model // 4)]
  coarse.sort(key=lambda r: r[1])
  fine = [(*_nelder_mead(lambda x, C=C: loss(x, C), x, 0.3, 40), C) for x, _, C in coarse[:2]]
  x, _, C = min(fine, key=lambda r: r[1])
  knobs = _knobs(x, C, stats)
  return knobs, simulated_stats(knobs, k, draws)


# ---------------------------------------------------------------------------------------------
# The weights that realise the knobs.

class Construction:
  """The embedding, output and router values of a routing-realistic file (module docstring):
  float32 rows, a function of (shape, knobs, seed) only.

  Args:
    d_model, n_vocab, n_layers, n_experts: the model's shape (routers for layers 0..n_layers-1).
  """

  def __init__(self, d_model: int, n_vocab: int, n_layers: int, n_experts: int, knobs: Knobs,
               seed: int):
    d, C = d_model, knobs.topics
    if C * 4 > d:
      raise ValueError(f"{C} topics need d_model >= {4 * C}, got {d}")
    self.d, self.knobs, self.seed = d, knobs, seed
    rng = np.random.default_rng([seed, 0x70C5])
    self.u = np.linalg.qr(rng.standard_normal((d, C)))[0].T.astype(np.float32)  # [C, d]
    self.topic = topic_of(n_vocab, C, seed)
    self.scale = EMBED_RMS_PER_LAYER * math.sqrt(n_layers) * math.sqrt(d)  # embedding row norm
    n_c = n_vocab / C
    # a decode stays in its topic with probability stay: own-topic tokens get delta more logit
    delta = math.log(knobs.stay / (1 - knobs.stay)) + math.log((n_vocab - n_c) / n_c)
    self.gamma = delta / (math.sqrt(d) * math.cos(PHI))
    self.routers = []
    noise = None
    for _ in range(n_layers):
      pref = knobs.theta * rng.standard_normal((C, n_experts)) + knobs.beta * rng.standard_normal(
          n_experts)
      fresh = self._off_topics(rng.standard_normal((n_experts, d))) / (math.sqrt(d)
                                                                         * math.sin(PHI))
      if noise is None:
        noise = fresh
      else:
        moved = knobs.rho * noise + math.sqrt(1 - knobs.rho**2) * fresh
        noise = np.empty_like(moved)
        noise[rng.permutation(n_experts)] = moved
      topical = pref.T @ self.u / (math.sqrt(d) * math.cos(PHI))  # [E, d]
      self.routers.append((topical + noise).astype(np.float32))

  def _off_topics(self, x: np.ndarray) -> np.ndarray:
    """x [n, d] without its components along the topic directions."""
    return x - (x @ self.u.T) @ self.u

  def embedding_rows(self, lo: int, hi: int) -> np.ndarray:
    """Rows lo..hi of the token embedding: float32 [hi - lo, d]."""
    g = self._off_topics(np.random.default_rng([self.seed, 0xE3B, lo]).standard_normal(
        (hi - lo, self.d), np.float32))
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    e = math.cos(PHI) * self.u[self.topic[lo:hi]] + math.sin(PHI) * g
    return (self.scale * e).astype(np.float32)

  def output_rows(self, lo: int, hi: int) -> np.ndarray:
    """Rows lo..hi of the output head: float32 [hi - lo, d]."""
    noise = self._off_topics(np.random.default_rng([self.seed, 0x0A7, lo]).standard_normal(
        (hi - lo, self.d), np.float32)) * np.float32(HEAD_NOISE / math.sqrt(self.d))
    return (self.gamma * self.u[self.topic[lo:hi]] + noise).astype(np.float32)
