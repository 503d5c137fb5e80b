"""The engine loop: one thread owns the device; it admits queued requests into free slots
(prefill, b=1, into the slot), then runs one decode step over all active slots, and hands each
request its tokens through a callback. Greedy decoding (argmax of each row's logits)."""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from jaxvt.serve.batch import BatchSession
from jaxvt.serve.scheduler import Request, Scheduler


class EngineLoop:
  """`submit` from any thread; `on_done(req)` is called from the loop thread when a request
  finishes (its `tokens`, `text` and `finish_reason` are final)."""

  def __init__(self, engine, max_batch: int, max_queue: int,
               decode_text: Callable[[int], str] = lambda t: ""):
    self.session = BatchSession(engine, max_batch)
    self.sched = Scheduler(max_batch, max_queue)
    self.decode_text = decode_text
    self._cv = threading.Condition()
    self._stop = False
    self._done: dict[int, threading.Event] = {}
    self._next: dict[int, int] = {}
    self.thread = threading.Thread(target=self._run, name="jaxvt-engine", daemon=True)
    self.thread.start()

  def submit(self, req: Request) -> threading.Event:
    """Queues `req` (QueueFull when the queue is full); the event is set when it finishes."""
    with self._cv:
      self.sched.submit(req)
      ev = self._done[req.id] = threading.Event()
      self._cv.notify()
    return ev

  def close(self, timeout: float = 30.0) -> None:
    """Lets in-flight and queued requests finish (bounded by `timeout`), then stops."""
    with self._cv:
      self._stop = True
      self._cv.notify()
    self.thread.join(timeout)

  def _run(self) -> None:
    while True:
      with self._cv:
        while self.sched.idle() and not self._stop:
          self._cv.wait()
        if self.sched.idle() and self._stop:
          return
        admitted = self.sched.admit()
      sampled = {}
      for req in admitted:
        logits = self.session.prefill(req.slot, req.prompt)
        sampled[req.slot] = int(np.argmax(np.asarray(logits)))
      feed = {r.slot: self._next[r.id] for r in self.sched.active() if r.id in self._next}
      if feed:
        logits = np.asarray(self.session.decode(feed))
        for s in feed:
          sampled[s] = int(np.argmax(logits[s]))
      with self._cv:
        by_slot = {s: self.sched.slots[s] for s in sampled}
        finished = self.sched.step({s: (t, self.decode_text(t)) for s, t in sampled.items()})
      for s, t in sampled.items():
        self._next[by_slot[s].id] = t
      for req in finished:
        self._next.pop(req.id, None)
        self._done.pop(req.id).set()
