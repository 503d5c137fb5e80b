"""What an operator watches: `GET /metrics` in Prometheus' text format (prometheus-client) and an
access log line per HTTP request on the `jaxvt.serve` logger.

Names follow vLLM's where it exports the same thing (`vllm:` -> `jaxvt:`; HTTP requests as its
instrumentator's `http_requests_total`), with llama-server's meaning for slots:

  http_requests_total{method, handler, status}   every HTTP request answered, by status code
  jaxvt:request_success_total{finished_reason}   generations ended: stop | length | abort |
                                                  error (abort: the client went away)
  jaxvt:prompt_tokens_total, jaxvt:generation_tokens_total
  jaxvt:time_to_first_token_seconds              histogram: request queued -> first token
  jaxvt:inter_token_latency_seconds              histogram: between a request's tokens as the
                                                  engine hands them out (a program of several
                                                  decode steps hands them out together)
  jaxvt:e2e_request_latency_seconds, jaxvt:request_queue_time_seconds   histograms
  jaxvt:num_requests_running, jaxvt:num_requests_waiting, jaxvt:num_slots   slots in use,
                                                  queue depth, slots (--max-batch)
  jaxvt:prefix_cache_queries_total, jaxvt:prefix_cache_hits_total   prompt tokens looked up in
                                                  the prefix cache and tokens it supplied
  jaxvt:prefix_cache_requests_hit_total, jaxvt:prefix_cache_entries, jaxvt:prefix_cache_bytes
  jaxvt:expert_cache_hits_total, jaxvt:expert_cache_misses_total   routed-expert reads
                                                  (jaxvt.engine.expert_cache_stats)
  jaxvt:expert_cache_hit_bytes_total, jaxvt:expert_cache_host_bytes_total   bytes they read
  jaxvt:expert_cache_fill_bytes_total           bytes the misses read over the bus: each
                                                  distinct missed expert of a call once

The engine loop tells `Metrics` of each request's life (EngineLoop.observer: submitted,
admitted, tokens, finished; on the loop's thread, cheap). `AccessLog`, an ASGI middleware, counts
each HTTP request by status and logs one line when its response has been sent, with the
generation's tokens and times where the request made one (found through a context variable the
middleware sets and `submitted` reads: the handler runs in the middleware's context).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxvt.engine import expert_cache_stats

log = logging.getLogger("jaxvt.serve")

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


@dataclasses.dataclass
class Timing:
  """One generation's clock readings (time.monotonic) and its HTTP request's record."""
  submitted: float
  admitted: float | None = None
  first: float | None = None
  last: float | None = None
  seen: int = 0  # tokens already counted
  access: "Access | None" = None


@dataclasses.dataclass
class Access:
  """What the access log line of one HTTP request says about its generation."""
  prompt: int = 0
  completion: int = 0
  cached: int = 0
  ttft: float | None = None
  finish: str = ""


_current: contextvars.ContextVar[Access | None] = contextvars.ContextVar("jaxvt_access",
                                                                         default=None)


class Metrics:
  """The server's Prometheus registry (its own: several servers in one process stay apart) and
  the engine loop's observer. `loop`: the EngineLoop (queue, slots, prefix cache); `engine`:
  its Engine (the expert cache's counters, read from its placed weights at each scrape)."""

  def __init__(self, loop, engine, max_batch: int):
    self.loop, self.engine, self.max_batch = loop, engine, max_batch
    self.registry = r = CollectorRegistry()
    self.http = Counter("http_requests", "HTTP requests answered", ["method", "handler", "status"],
                        registry=r)
    self.success = Counter("jaxvt:request_success", "Generations ended, by finish reason",
                           ["finished_reason"], registry=r)
    self.prompt_tokens = Counter("jaxvt:prompt_tokens", "Prompt tokens of ended generations",
                                 registry=r)
    self.generation_tokens = Counter("jaxvt:generation_tokens", "Tokens generated", registry=r)
    self.ttft = Histogram("jaxvt:time_to_first_token_seconds", "Queued to first token",
                          buckets=TTFT_BUCKETS, registry=r)
    self.itl = Histogram("jaxvt:inter_token_latency_seconds", "Between a request's tokens",
                         buckets=ITL_BUCKETS, registry=r)
    self.e2e = Histogram("jaxvt:e2e_request_latency_seconds", "Queued to ended",
                         buckets=E2E_BUCKETS, registry=r)
    self.queue_time = Histogram("jaxvt:request_queue_time_seconds", "Queued to given a slot",
                                buckets=TTFT_BUCKETS, registry=r)
    self.prefix_queries = Counter("jaxvt:prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache", registry=r)
    self._timing: dict[int, Timing] = {}  # by request id, while the request lives
    r.register(_Scraped(self))

  # -- the engine loop's observer (EngineLoop.observer) ------------------------------------------

  def submitted(self, req) -> None:
    """`req` was queued (on the handler's thread and context)."""
    self._timing[req.id] = Timing(time.monotonic(), access=_current.get())

  def admitted(self, req) -> None:
    t = self._timing.get(req.id)
    if t is not None and t.admitted is None:
      t.admitted = time.monotonic()
      self.queue_time.observe(t.admitted - t.submitted)
      self.prefix_queries.inc(len(req.prompt))

  def tokens(self, req) -> None:
    """`req` has new tokens (req.tokens grew since the last call)."""
    t = self._timing.get(req.id)
    n = len(req.tokens)
    if t is None or n <= t.seen:
      return
    now = time.monotonic()
    if t.first is None:
      t.first = now
      self.ttft.observe(now - t.submitted)
    elif t.last is not None:
      self.itl.observe(now - t.last)
    for _ in range(n - t.seen - 1):  # the rest of a program's tokens came at the same time
      self.itl.observe(0.0)
    t.last, t.seen = now, n

  def finished(self, req) -> None:
    """`req` ended (any reason; called once)."""
    self.tokens(req)
    t = self._timing.pop(req.id, None)
    reason = FINISHED.get(req.finish_reason or "", req.finish_reason or "unknown")
    self.success.labels(reason).inc()
    self.prompt_tokens.inc(len(req.prompt))
    self.generation_tokens.inc(len(req.tokens))
    if t is None:
      return
    self.e2e.observe(time.monotonic() - t.submitted)
    if t.access is not None:
      a = t.access
      a.prompt, a.completion, a.cached, a.finish = (len(req.prompt), len(req.tokens), req.cached,
                                                    reason)
      a.ttft = None if t.first is None else t.first - t.submitted

  def live(self) -> int:
    """Requests the observer still tracks (tests: nothing leaks)."""
    return len(self._timing)

  # -- /metrics ----------------------------------------------------------------------------------

  def exposition(self) -> tuple[bytes, str]:
    """(the text format's bytes, its content type)."""
    return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Scraped:
  """The values read at scrape time: queue, slots, the prefix and the expert cache."""

  def __init__(self, m: Metrics):
    self.m = m

  def describe(self):
    return []  # no fixed names needed at registration; collect() says them

  def collect(self):
    m = self.m
    counts = m.loop.counts()
    yield _gauge("jaxvt:num_requests_running", "Requests decoding (slots in use)",
                 counts["active"])
    yield _gauge("jaxvt:num_requests_waiting", "Requests waiting for a slot", counts["queued"])
    yield _gauge("jaxvt:num_slots", "Slots (requests decoded together at most)", m.max_batch)
    pc = m.loop.session.prefix
    if pc is not None:
      entries, nbytes = _prefix_sizes(pc)
      yield _counter("jaxvt:prefix_cache_hits", "Prompt tokens the prefix cache supplied",
                     pc.reused_tokens)
      yield _counter("jaxvt:prefix_cache_requests_hit", "Prompts that reused a prefix", pc.hits)
      yield _gauge("jaxvt:prefix_cache_entries", "Sequences the prefix cache holds", entries)
      yield _gauge("jaxvt:prefix_cache_bytes", "Bytes the prefix cache holds", nbytes)
    xs = expert_cache_stats(m.engine.weights)
    if xs is not None:
      yield _counter("jaxvt:expert_cache_hits", "Routed-expert reads from the cache", xs.hits)
      yield _counter("jaxvt:expert_cache_misses", "Routed-expert reads over the bus", xs.misses)
      yield _counter("jaxvt:expert_cache_hit_bytes", "Bytes read from the expert cache",
                     xs.hit_bytes)
      yield _counter("jaxvt:expert_cache_host_bytes", "Bytes the expert cache's misses read",
                     xs.host_bytes)
      yield _counter("jaxvt:expert_cache_fill_bytes",
                     "Bytes the expert cache filled over the bus (a call's distinct misses)",
                     xs.fill_bytes)


def _prefix_sizes(pc) -> tuple[int, int]:
  """(entries, bytes) of the prefix cache, which the engine thread may change meanwhile (a
  change during the sum is retried)."""
  for _ in range(5):
    try:
      return len(pc), pc.nbytes
    except RuntimeError:  # the dict changed size during the sum
      continue
  return len(pc), 0


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
  return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
  return CounterMetricFamily(name, doc, value=value)


class AccessLog:
  """ASGI middleware: counts each HTTP request by (method, handler, status) and logs one line
  when its response has been sent: client, method, path, status, the generation's prompt,
  completion and cached tokens, finish reason, time to first token and total time."""

  def __init__(self, app, metrics: Metrics, handlers: frozenset[str]):
    self.app, self.metrics, self.handlers = app, metrics, handlers

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    start, status = time.monotonic(), [0]
    access = Access()
    token = _current.set(access)

    async def sending(message):
      if message["type"] == "http.response.start":
        status[0] = message["status"]
      await send(message)

    try:
      await self.app(scope, receive, sending)
    finally:
      _current.reset(token)
      path = scope.get("path", "")
      code = status[0] or 500  # no response started: the app failed or the client left
      self.metrics.http.labels(scope.get("method", ""),
                               path if path in self.handlers else "other", str(code)).inc()
      client = scope.get("client") or ("-", 0)
      gen = "" if not access.finish else (
          f" prompt={access.prompt} cached={access.cached} completion={access.completion} "
          f"finish={access.finish} ttft="
          + ("-" if access.ttft is None else f"{access.ttft:.3f}s"))
      log.info('%s "%s %s" %d%s time=%.3fs', client[0], scope.get("method", ""), path, code, gen,
               time.monotonic() - start)
