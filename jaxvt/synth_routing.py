"""Routing-realistic synthetic MoE models: the statistics of a decode's expert choices, a model of
how topic-structured weights produce them, and the weights that realise it (jaxvt.synth writes
them when `write_model(..., routing=RoutingStats(...))`; PRESETS names the `realistic` and the
`high-locality` file).

The statistics of a trace `ids` int [T, L, k] (the k experts each of L MoE layers chose for each
of T consecutive decode tokens) out of E experts:

- reuse within w: the fraction of token t's chosen experts (at a layer) that one of the w tokens
  before it (t-w .. t-1) chose at that layer, over t >= w: the hit rate of a per-layer cache
  holding the experts of the last w tokens. w = 1 is next-token reuse. Memoryless uniform
  routing gives k/E at w = 1 and about 1 - (1 - k/E)^w.
- skew: the share of all selections at a layer taken by its ceil(E/10) most chosen experts over
  the trace (uniform routing: 0.1 plus the sampling noise of T*k selections).
- LRU hit rate at a capacity (a share of the layer's experts): the hits of a per-layer LRU
  cache of experts over the decode (lru_hits), cold misses included.
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

The drifting process (RoutingStats.lru_curve set; PRESETS["realistic"]). Real routing reuses as
much from token to token, but its working set drifts: a 512-expert model's 32 most used experts
on half a workload cover about a tenth of the other half, and an LRU cache's hit rate rises
slowly with its size (REAL_LRU_CURVE). Few independent topics cannot give that: the reuse comes
from a small static working set (the top 10% of experts take about 85% of the selections), so
the whole of it fits a cache. Here the C = drift_topics() topics lie on a ring, each topic's
preferences are a random field smoothed along the ring (`width` topics, `smooth`) and cut at
`core` (theta * max(z - core, 0): how many experts a topic favours), and a topic change goes to
the next topic of the ring with probability `forward` (the head adds `ahead` logits to the next
topic's tokens) and otherwise to any other topic. The walk along the ring moves the working set
gradually (LRU hits at large capacities: the experts of the last tens of tokens come back), the
topic's spread over more than k experts with the token's own part sets the short-range reuse
and the curve's low end, and the walk's covering the ring over a decode keeps the static skew
low (`max_skew`, a stiff penalty). It was chosen over a per-expert Markov / renewal process
because the routing must come out of the model's own router on the normed residual, which here
is a function of the current token: a Markov chain over tokens (the head) with per-token routing
realises a topic walk exactly, while per-expert renewal times cannot be written into a router.
`calibrate` fits (stay, forward, theta, width, core) by simulating the walk and the LRU cache
(lru_hits) on sequences of RoutingStats.tokens tokens. The real curve mixes models (128 experts
top-8, 512 top-10) and is given as shares of a layer's experts: on 128 experts top-8 the fit
lands within 0.04 of every point and reuse target; on 256 experts top-8 a 6% cache holds two
tokens' experts, so its hit rate cannot fall below about next-token reuse, and the least-squares
fit trades the two (docs/BENCHMARKS.md, "routing").

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
DRIFT_TOPICS = 64  # topics on the drifting process's ring (fewer where d_model / 4 is less)


# LRU hit rate of real routing traces at cache capacities given as shares of a layer's experts:
# Qwen3-30B-A3B (128 experts, top-8; 6%, 19%, 38%, 64%) and a 512-expert top-10 model (12.5%, 25%)
REAL_LRU_CURVE = ((0.06, 0.37), (0.125, 0.67), (0.19, 0.74), (0.25, 0.81), (0.38, 0.89),
                  (0.64, 0.96))


@dataclasses.dataclass(frozen=True)
class RoutingStats:
  """Target statistics of a decode's expert choices (see the module docstring for each), as a
  decode of `tokens` tokens at temperature 1 measures them (`benchmarks.routing`). The defaults
  of the two reuse figures are those of real Qwen3-30B-A3B routing traces; skew and next-layer
  predictability None: not targeted, the value the topic structure gives (the probe reports it).

  `lru_curve` ((capacity as a share of a layer's experts, LRU hit rate), ...) targets the hit
  rate of a per-layer LRU cache (lru_hits) and selects the drifting process (module docstring);
  `max_skew` caps the skew (a limit, not a target). PRESETS names the two files benchmarks use.
  """

  next_token_reuse: float = 0.45
  reuse_within_8: float = 0.80
  skew: float | None = None  # share of selections taken by the top 10% of experts
  next_layer_predictability: float | None = None
  tokens: int = 512  # decode length the statistics are of (skew and predictability depend on it)
  lru_curve: tuple[tuple[float, float], ...] | None = None
  max_skew: float | None = None
  # the largest miss of a target that write_model accepts from the calibrated construction
  tolerance: float = 0.05

  def __post_init__(self):
    for name in ("next_token_reuse", "reuse_within_8", "skew", "next_layer_predictability",
                 "max_skew", "tolerance"):
      v = getattr(self, name)
      if v is not None and not 0.0 < v < 1.0:
        raise ValueError(f"RoutingStats.{name} must lie in (0, 1), got {v}")
    if self.reuse_within_8 < self.next_token_reuse:
      raise ValueError("RoutingStats.reuse_within_8 must be >= next_token_reuse (a window of 8 "
                       "holds the next token's)")
    if self.tokens < 32:
      raise ValueError(f"RoutingStats.tokens must be >= 32, got {self.tokens}")
    if self.lru_curve is not None:
      pts = [tuple(p) for p in self.lru_curve]
      if not pts or any(len(p) != 2 or not (0 < p[0] <= 1 and 0 < p[1] < 1) for p in pts):
        raise ValueError("RoutingStats.lru_curve holds (capacity share in (0, 1], hit rate in "
                         f"(0, 1)) pairs, got {self.lru_curve}")
      if any(b[0] <= a[0] or b[1] < a[1] for a, b in zip(pts, pts[1:])):
        raise ValueError("RoutingStats.lru_curve: capacities must rise and hit rates not fall")
    if self.skew is not None and self.max_skew is not None and self.skew > self.max_skew:
      raise ValueError(f"RoutingStats.skew {self.skew} is above max_skew {self.max_skew}")

  @property
  def drifting(self) -> bool:
    """Whether calibrate fits the drifting process (an LRU curve is targeted)."""
    return self.lru_curve is not None

  def capacities(self) -> tuple[float, ...]:
    """The targeted LRU capacities (shares of a layer's experts)."""
    return tuple(c for c, _ in self.lru_curve or ())

  def targets(self) -> dict[str, float]:
    """{statistic name: target} of the targeted statistics (LRU points as `lru@SHARE`)."""
    out = {"next_token_reuse": self.next_token_reuse, "reuse_within_8": self.reuse_within_8,
           "skew": self.skew, "next_layer_predictability": self.next_layer_predictability}
    out.update({lru_name(c): h for c, h in self.lru_curve or ()})
    return {k: v for k, v in out.items() if v is not None}


def lru_name(share: float) -> str:
  """The statistic name of the LRU hit rate at a capacity of `share` of a layer's experts."""
  return f"lru@{share:g}"


PRESETS = {
    # few topics, uniform jumps: reuse like real routing, but the top 10% of experts take about
    # 85% of the selections, so a cache holds the whole working set (an upper bound)
    "high-locality": RoutingStats(),
    # the working set drifts: real LRU hit rates, reuse and a capped skew
    # (the points are shares of a layer's experts, measured on 128 experts top-8 and 512 top-10:
    # with 256 experts top-8 a 6% cache holds two tokens' experts, so its hit rate is at least
    # about next-token reuse, and the fit trades the two: on the Qwen3.6-35B-A3B shape it gives
    # next-token reuse 0.30 against 0.45 and 0.48 hits at 6% against 0.37, hence the tolerance)
    "realistic": RoutingStats(tokens=1024, lru_curve=REAL_LRU_CURVE, max_skew=0.3,
                              tolerance=0.16),
}


@dataclasses.dataclass(frozen=True)
class Knobs:
  """The construction's parameters (module docstring): topics C, stay probability, topic
  strength theta, popularity beta, cross-layer token correlation rho; the drifting process's
  `forward` (the share of topic changes that go to the next topic on the ring; None: every other
  topic alike) and `width` (the topics' preferences are smoothed over the ring with a Gaussian
  of this many topics; 0: independent) and `core` (a topic's preference for an expert is
  theta * max(z - core, 0) of its smoothed z: a high core concentrates it on fewer experts)."""
  topics: int
  stay: float
  theta: float
  beta: float
  rho: float
  forward: float | None = None
  width: float = 0.0
  core: float = -math.inf

  def preferences(self, z: np.ndarray) -> np.ndarray:
    """The topics' expert preferences theta * P [C, E] from independent N(0, 1) draws z [C, E]
    (the drifting process's smoothing and core; z itself for the other)."""
    if self.forward is None:
      return self.theta * z
    zs = smooth(z, self.width)
    return self.theta * (np.maximum(zs - self.core, 0.0) if math.isfinite(self.core) else zs)


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


def lru_hits(ids: np.ndarray, n_experts: int, capacities) -> np.ndarray:
  """Per layer and capacity [L, len(capacities)]: the hit rate of a per-layer LRU cache of
  `capacity` experts (a share of n_experts) over the trace ids int [T, L, k], cold misses
  included. The cache works in decode steps: at step t the layer looks up its k experts, then all
  k are the most recently used (the step's order among them is not observable, so experts last
  used in the same step tie, and a tie that straddles the capacity counts as the expected share
  of a random order). An expert last used at step p is held at step t when the D experts used
  since (steps p+1..t-1) and its g tied ones fit: hit = clip((capacity - D) / g, 0, 1)."""
  T, L, k = ids.shape
  caps = np.asarray(capacities, np.float64) * n_experts
  out = np.zeros((L, len(caps)))
  steps = np.arange(T)
  for l in range(L):
    oh = np.zeros((T, n_experts), bool)
    np.put_along_axis(oh, ids[:, l], True, axis=1)
    used = np.maximum.accumulate(np.where(oh, steps[:, None], -1), axis=0)
    last = np.vstack([np.full((1, n_experts), -1), used[:-1]])  # [T, E]: last step before t
    # one sorted array of every row's last-use steps, rows offset apart (searchsorted per row)
    off = (steps * (T + 1))[:, None]
    flat = np.sort(last, axis=1) + 1 + off
    p = np.take_along_axis(last, ids[:, l], axis=1)  # [T, k]
    q = (p + 1 + off).ravel()
    lo = np.searchsorted(flat.ravel(), q, "left")
    hi = np.searchsorted(flat.ravel(), q, "right")
    row_end = ((steps + 1) * n_experts).repeat(k)
    newer, tied = (row_end - hi).astype(np.float64), (hi - lo).astype(np.float64)
    warm = p.ravel() >= 0
    held = np.clip((caps[None, :] - newer[:, None]) / tied[:, None], 0.0, 1.0)
    out[l] = (held * warm[:, None]).sum(axis=0) / (T * k)
  return out


def measure(ids: np.ndarray, n_experts: int,
            capacities=(), predictability: bool = True) -> dict[str, np.ndarray]:
  """{statistic name: per-layer values} of a trace ids int [T, L, k]: next_token_reuse,
  reuse_within_8, skew ([L]), next_layer_predictability ([L-1]; left out unless
  `predictability`) and the LRU hit rate `lru@SHARE` at each of `capacities` ([L])."""
  out = {"next_token_reuse": reuse(ids, n_experts, 1),
         "reuse_within_8": reuse(ids, n_experts, 8),
         "skew": skew(ids, n_experts)}
  if predictability:
    out["next_layer_predictability"] = next_layer_predictability(ids, n_experts)
  if len(capacities):
    hits = lru_hits(ids, n_experts, capacities)
    out.update({lru_name(c): hits[:, i] for i, c in enumerate(capacities)})
  return out


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
  z_ring: np.ndarray  # [2, DRIFT_TOPICS, E] the drifting process's, before smoothing

  @classmethod
  def make(cls, n_experts: int, n_vocab: int, tokens: int, seed: int) -> "Draws":
    rng = np.random.default_rng([seed, 0x51])
    V = min(n_vocab, _SIM_VOCAB)
    return cls(rng.random(tokens), rng.random(tokens), rng.random(tokens),
               rng.standard_normal((V, n_experts)), rng.standard_normal((V, n_experts)),
               rng.permutation(n_experts),
               rng.standard_normal((2, max(_TOPIC_CHOICES), n_experts)),
               rng.standard_normal((2, n_experts)),
               np.random.default_rng([seed, 0x52]).standard_normal((2, DRIFT_TOPICS, n_experts)))


def smooth(z: np.ndarray, width: float) -> np.ndarray:
  """z [C, E] (independent N(0, 1) rows, one per topic of the ring) smoothed along the ring with
  a Gaussian of `width` topics, rescaled to unit variance: neighbouring topics prefer similar
  experts, so a walk along the ring moves the working set gradually. width 0: z itself."""
  if width <= 0:
    return z
  C = z.shape[0]
  dist = np.minimum(np.arange(C), C - np.arange(C))
  kern = np.exp(-0.5 * (dist / width) ** 2)
  kern /= np.sqrt((kern**2).sum())
  return np.real(np.fft.ifft(np.fft.fft(kern)[:, None] * np.fft.fft(z, axis=0), axis=0))


def next_topic(c: np.ndarray, u_offset: np.ndarray, forward: float | None,
               topics: int) -> np.ndarray:
  """The topic a change from c goes to: the next one on the ring for a share `forward` of the
  changes (u_offset < forward), else one of the others (not c, not c + 1) alike; forward None:
  every other topic alike."""
  C = topics
  if forward is None:
    return (c + 1 + np.floor(u_offset * (C - 1)).astype(np.int64)) % C
  rest = 2 + np.floor((u_offset - forward) / (1 - forward) * (C - 2)).astype(np.int64)
  return (c + np.where(u_offset < forward, 1, np.minimum(rest, C - 1))) % C


def simulate(knobs: Knobs, k: int, draws: Draws) -> np.ndarray:
  """A trace int [T, 2, k] (two consecutive layers) of the process the weights realise (module
  docstring), from one sequence's draws."""
  V, E = draws.xi.shape
  C = knobs.topics
  members = -(-V // C)  # tokens of a topic: token = topic + C * member
  jump = draws.u_jump < 1.0 - knobs.stay
  jump[0] = True
  offset = next_topic(np.zeros(len(jump), np.int64), draws.u_offset, knobs.forward, C)
  c = np.cumsum(np.where(jump, offset, 0)) % C  # a change's offset does not depend on c
  tok = np.minimum(c + C * np.floor(draws.u_member * members).astype(np.int64), V - 1)
  c = tok % C
  xi = draws.xi[tok]
  ids = np.empty((len(tok), 2, k), np.int64)
  for l in range(2):
    if l:
      moved = knobs.rho * xi + math.sqrt(1 - knobs.rho**2) * draws.fresh[tok]
      xi = np.empty_like(moved)
      xi[:, draws.perm] = moved
    pref = knobs.preferences(draws.z[l] if knobs.forward is None else draws.z_ring[l, :C])
    logits = pref[c] + knobs.beta * draws.b[l] + xi
    ids[:, l] = np.argpartition(-logits, k - 1, axis=1)[:, :k]
  return ids


def simulated_stats(knobs: Knobs, k: int, draws: list[Draws], capacities=(),
                    predictability: bool = True) -> dict[str, float]:
  """The statistics of the simulated sequences of `draws` (measure's), averaged."""
  E = draws[0].xi.shape[1]
  acc: dict[str, list[float]] = {}
  for d in draws:
    for name, v in measure(simulate(knobs, k, d), E, capacities, predictability).items():
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
  if stats.drifting:
    return _calibrate_drifting(stats, n_experts, k, n_vocab, d_model)
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


def drift_topics(n_vocab: int, d_model: int) -> int:
  """The drifting process's ring: DRIFT_TOPICS topics, fewer where Construction's d_model / 4
  or a vocabulary of 8 tokens a topic allows fewer (at least 4)."""
  C = min(DRIFT_TOPICS, d_model // 4, n_vocab // 8)
  if C < 4:
    raise ValueError(f"the drifting routing process needs d_model >= 16 and a vocabulary of >= 32 "
                     f"tokens, got {d_model} and {n_vocab}")
  return C


def _drift_knobs(x: np.ndarray, topics: int, stats: RoutingStats) -> Knobs:
  """Unconstrained coordinates -> the drifting process's knobs (beta, rho 0 unless targeted)."""
  sig = lambda t: 1.0 / (1.0 + math.exp(-t))
  return Knobs(topics=topics, stay=0.02 + 0.97 * sig(x[0]), theta=math.exp(x[2]),
               beta=math.exp(x[4]) if stats.skew is not None else 0.0,
               rho=0.98 * sig(x[5]) if stats.next_layer_predictability is not None else 0.0,
               forward=0.02 + 0.97 * sig(x[1]), width=0.25 + math.exp(x[3]), core=x[6])


SKEW_WEIGHT = 400.0  # loss weight of the squared excess of the skew over max_skew (a stiff limit)


def _calibrate_drifting(stats: RoutingStats, n_experts: int, k: int, n_vocab: int,
                        d_model: int) -> tuple[Knobs, dict[str, float]]:
  """calibrate's drifting process: the ring's topic count is fixed (drift_topics); a search over
  (stay, forward, theta, width[, beta, rho]) minimises the squared error of the targets plus
  SKEW_WEIGHT times the squared excess of the skew over max_skew."""
  C = drift_topics(n_vocab, d_model)
  targets, caps = stats.targets(), stats.capacities()
  pred = stats.next_layer_predictability is not None
  draws = [Draws.make(n_experts, n_vocab, stats.tokens, s) for s in range(_SIM_SEQS // 2)]

  def loss(x):
    got = simulated_stats(_drift_knobs(x, C, stats), k, draws, caps, pred)
    err = sum((got[n] - t) ** 2 for n, t in targets.items())
    if stats.max_skew is not None:
      err += SKEW_WEIGHT * max(0.0, got["skew"] - stats.max_skew) ** 2
    return err

  x0 = np.array([1.5, 2.0, 0.5, 1.0, -1.0, 0.0, -1.0])
  active = [0, 1, 2, 3, 6] + [4] * (stats.skew is not None) + [5] * pred

  def full(xa):
    x = x0.copy()
    x[active] = xa
    return x

  x, _ = _nelder_mead(lambda xa: loss(full(xa)), x0[active], 1.0, 30)
  x, _ = _nelder_mead(lambda xa: loss(full(xa)), x, 0.3, 30)
  knobs = _drift_knobs(full(x), C, stats)
  return knobs, simulated_stats(knobs, k, draws, caps, True)


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
    if knobs.forward is None:
      delta, ahead = math.log(knobs.stay / (1 - knobs.stay)) + math.log((n_vocab - n_c) / n_c), 0.0
    else:  # and moves to the next topic with (1 - stay) forward: its tokens get `ahead` more
      rest = (1 - knobs.stay) * (1 - knobs.forward)  # spread over the n_vocab - 2 n_c others
      delta = math.log(knobs.stay / rest * (n_vocab - 2 * n_c) / n_c)
      ahead = math.log((1 - knobs.stay) * knobs.forward / rest * (n_vocab - 2 * n_c) / n_c)
    self.gamma = delta / (math.sqrt(d) * math.cos(PHI))
    self.gamma_ahead = ahead / (math.sqrt(d) * math.cos(PHI))
    self.routers = []
    noise = None
    for _ in range(n_layers):
      pref = knobs.preferences(rng.standard_normal((C, n_experts))) + knobs.beta * (
          rng.standard_normal(n_experts))
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
    c = self.topic[lo:hi]
    rows = self.gamma * self.u[c] + noise
    if self.gamma_ahead:  # row of a token of topic c: favoured from topic c - 1 too
      rows += self.gamma_ahead * self.u[(c - 1) % self.knobs.topics]
    return rows.astype(np.float32)
