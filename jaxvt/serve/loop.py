"""The engine loop: one thread owns the device. Before each decode program it admits queued
requests into free slots (each prefilled alone, b=1, into its slot, from the longest prefix the
prefix cache holds) and samples their first tokens; then one decode program steps every active
slot, each row sampled with its request's own parameters (jaxvt.sampling.sample_rows). While
the same requests go on, the next decode program is sent before the current one's tokens are
read (`_ahead`), so the host's work on them (detokenizing, the listeners, the scheduler) runs
while the device computes, as Engine.generate keeps a call in flight.

A request learns of its progress through `Request.listener` (called on this thread with the
request after each new token, and once more when it is done) and through the event `submit`
returns (set when it is done). `cancel` (a client gone) frees its slot at the next step.
`observer` (jaxvt.serve.metrics.Metrics, or None) hears of each request's life: submitted,
admitted, tokens, finished."""

from __future__ import annotations

import logging
import threading

from jaxvt.prefix import PrefixCache
from jaxvt.serve.batch import BatchSession, first_token
from jaxvt.serve.scheduler import Request, Scheduler

log = logging.getLogger("jaxvt.serve")
MAX_STEPS = 8  # decode steps per device program while no request waits (as generate's chunks)


class EngineLoop:
  """`submit` and `cancel` from any thread; the device work runs on the loop's own thread."""

  def __init__(self, engine, max_batch: int, max_queue: int, prefix: PrefixCache | None = None,
               session: BatchSession | None = None):
    """`session`: the BatchSession to run (default: a new one of `engine`, `max_batch` slots
    and `prefix`); over several processes, jaxvt.serve.follow's LeaderSession."""
    self.engine = engine
    self.session = session or BatchSession(engine, max_batch, prefix)
    self.sched = Scheduler(max_batch, max_queue)
    self._cv = threading.Condition()
    self._stop = False
    self._done: dict[int, threading.Event] = {}
    self.error: BaseException | None = None  # what stopped the loop, if anything did
    self.observer = None  # submitted/admitted/tokens/finished(req), called with the lock held
    self.thread = threading.Thread(target=self._run, name="jaxvt-engine", daemon=True)
    self.thread.start()

  def submit(self, req: Request) -> threading.Event:
    """Queues `req` (QueueFull when neither a slot nor the queue has room; RuntimeError once the
    loop is closing); the event is set when it is done."""
    with self._cv:
      if self._stop:
        raise RuntimeError("the server is shutting down")
      self.sched.submit(req)
      if self.observer:
        self.observer.submitted(req)
      ev = self._done[req.id] = threading.Event()
      self._cv.notify()
    return ev

  def cancel(self, req: Request) -> None:
    """Drops `req` (its client is gone): out of the queue, or its slot freed for the next one."""
    with self._cv:
      if not req.done:
        self.sched.cancel(req)
        self._finish(req)

  def counts(self) -> dict[str, int]:
    """Requests decoding now and waiting for a slot."""
    with self._cv:
      return {"active": len(self.sched.active()), "queued": len(self.sched.queue)}

  def close(self, timeout: float = 30.0) -> bool:
    """Refuses new requests, lets the ones in flight and queued finish (bounded by `timeout`
    seconds), then stops; False where the loop was still busy at the timeout."""
    with self._cv:
      self._stop = True
      self._cv.notify()
    self.thread.join(timeout)
    return not self.thread.is_alive()

  def _finish(self, req: Request) -> None:
    """With the lock held: tells the request's waiters it is done."""
    ev = self._done.pop(req.id, None)
    if self.observer:
      self.observer.finished(req)
    if req.listener:
      req.listener(req)
    if ev:
      ev.set()

  def _record(self, sampled: dict[int, int], exact: bool = True, compact: bool = True,
              logprobs: dict[int, tuple] | None = None) -> None:
    """Feeds one step's tokens (slot -> token) to the scheduler and the requests' listeners,
    with `logprobs` (slot -> token_logprobs' three arrays of its row) kept by the requests that
    asked for them.
    A finished request's sequence is stored for prefix reuse (with `exact`, its cache holds
    exactly `Request.fed`; else only its K/V rows are right: decode ran on past it). With
    `compact`, the requests left move down into the freed slots."""
    with self._cv:
      reqs = {s: self.sched.slots[s] for s in sampled if self.sched.slots[s] is not None}
      for s, r in reqs.items():
        if r.logprobs is not None and sampled[s] not in r.eos_ids:
          lp, ids, top = logprobs[s]
          r.token_logprobs.append((float(lp), [(int(i), float(x)) for i, x in
                                               zip(ids[:r.logprobs], top[:r.logprobs])]))
      pieces = {s: (t, "" if t in r.eos_ids else r.decoder.push(t) if r.decoder else "")
                for s, t in sampled.items() if (r := reqs.get(s)) is not None}
      finished = self.sched.step(pieces)
      for r in reqs.values():
        if self.observer:
          self.observer.tokens(r)
        if r.done and r.decoder and (r.eos or r.finish_reason == "length"):  # not cut by a stop
          r.text += r.decoder.flush()
        if r.listener and not r.done:
          r.listener(r)
      for r in finished:
        self._finish(r)
      for r in finished:
        self.session.finish(r.slot, r.fed, exact)
      if compact:
        for src, dst in self.sched.compact():  # the next step runs the fewest rows
          self.session.move(src, dst)

  def _steps(self, active: list[Request]) -> int:
    """Decode steps in the next program: a power of two up to MAX_STEPS, one while requests
    wait for a slot (they join at the next program) or a constrained request is in the batch,
    never past a request's max_tokens or the context. Tokens sampled after a request's end in
    the same program are dropped."""
    if self.sched.queue or any(r.constraint for r in active):
      return 1  # a constrained row's next mask depends on the token this step samples
    pos = self.session.positions
    room = min(min(r.max_tokens - len(r.tokens), self.engine.max_context - int(pos[r.slot]))
               for r in active)
    return max(1, min(MAX_STEPS, 1 << (max(room, 1).bit_length() - 1)))

  def _run(self) -> None:
    try:
      self._loop()
    except BaseException as e:  # pylint: disable=broad-except  (every waiter must hear of it)
      log.exception("the engine loop stopped")
      with self._cv:
        self.error = e
        self._stop = True
        for r in list(self.sched.queue) + self.sched.active():
          self.sched.cancel(r)
          r.finish_reason = "error"
          self._finish(r)

  def _loop(self) -> None:
    while True:
      with self._cv:
        while self.sched.idle() and not self._stop:
          self._cv.wait()
        if self.sched.idle() and self._stop:
          return
        admitted = self.sched.admit()
        for req in admitted if self.observer else ():
          self.observer.admitted(req)
      first, first_lps = {}, {}
      for req in admitted:
        logits, req.cached = self.session.prefill(req.slot, req.prompt)
        tok, first_lps[req.slot] = first_token(
            logits, _params(req), logprobs=req.logprobs is not None,
            mask=req.constraint.mask() if req.constraint else None)
        self.session.start(req.slot, tok,
                           penalized=bool(req.frequency_penalty or req.presence_penalty))
        first[req.slot] = tok
      self._record(first, logprobs=first_lps)
      with self._cv:
        active = self.sched.active()
        steps = self._steps(active) if active else 0
      if not active:
        continue
      masks = {r.slot: r.constraint.mask() for r in active if r.constraint}
      run = (active, steps, self.session.dispatch(
          {r.slot: (r.tokens[-1], _params(r)) for r in active}, steps,
          logprobs=any(r.logprobs is not None for r in active), masks=masks))
      while run is not None:
        ahead = self._ahead(*run[:2])  # sent before this one's tokens are read
        self._read(run, last=ahead is None)
        run = ahead

  def _ahead(self, active: list[Request], steps: int):
    """The next decode program of `active`, dispatched while their current program of `steps`
    steps runs (its tokens not read yet, so the host's reading, detokenizing and answering
    overlap the device's next steps), where these requests go on whatever that program samples:
    none is done, none waits for a slot, none is constrained or asks for logprobs (those need
    each step's token on the host first), and each has tokens left to make after those steps
    (an end-of-generation token or a stop string may still end one there: its tokens from this
    program are then dropped). Returns (active, steps, the dispatch) or None."""
    with self._cv:
      if self.sched.queue or any(r.done or r.constraint or r.logprobs is not None
                                 for r in active):
        return None
      pos = self.session.positions  # already past the current program
      room = min(min(r.max_tokens - len(r.tokens) - steps,
                     self.engine.max_context - int(pos[r.slot])) for r in active)
      if room < 1:
        return None
      n = min(MAX_STEPS, 1 << (room.bit_length() - 1))
      feed = {r.slot: (0, _params(r, len(r.tokens) + steps)) for r in active}
    return active, n, self.session.dispatch(feed, n, ahead=True)

  def _read(self, run: tuple, last: bool) -> None:
    """Records the tokens of a dispatched decode program (`run`: active, steps, the dispatch);
    `last`: no program was dispatched after it, so the cache holds exactly what it fed at its
    end and the slots may be compacted."""
    active, steps, handle = run
    out, lps = self.session.read(handle)
    for i in range(steps):
      end = last and i == steps - 1
      self._record({r.slot: int(out[i, r.slot]) for r in active}, exact=end, compact=end,
                   logprobs=None if lps is None else {
                       r.slot: tuple(a[i, r.slot] for a in lps) for r in active})


def _params(r: Request, index: int | None = None) -> tuple:
  """sample's row parameters of `r`'s next token (its index: how many it has made, unless
  `index` says which)."""
  return (r.temperature, r.top_k, r.top_p, r.seed, len(r.tokens) if index is None else index,
          r.logit_bias, r.frequency_penalty, r.presence_penalty)
