"""A pure continuous-batching scheduler: no model, no device, no threads.

The engine loop asks it, before each device program, which queued requests join the batch
(`admit`), feeds it each step's sampled token per active slot (`step`), and it says which
requests finished (eos, a stop string, max_tokens) and frees their slots. Requests that arrive
while others decode wait in a bounded FIFO queue and take the next free slot; a full queue is
refused at once (`QueueFull`: the server answers 429 with Retry-After).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools


class QueueFull(Exception):
  """The wait queue holds `max_queue` requests already."""


@dataclasses.dataclass
class Request:
  """One generation: its prompt token ids and how it ends."""
  prompt: list[int]
  max_tokens: int
  eos_ids: frozenset[int] = frozenset()
  stop: tuple[str, ...] = ()
  id: int = dataclasses.field(default_factory=itertools.count().__next__)
  tokens: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  finish_reason: str | None = None  # "stop" | "length" | "cancelled" once done
  slot: int | None = None

  @property
  def done(self) -> bool:
    return self.finish_reason is not None


class Scheduler:
  """Slots 0..max_batch-1 of the batched cache, and a FIFO of requests waiting for one."""

  def __init__(self, max_batch: int, max_queue: int):
    if max_batch < 1 or max_queue < 0:
      raise ValueError(f"max_batch {max_batch} must be >= 1 and max_queue {max_queue} >= 0")
    self.max_batch = max_batch
    self.max_queue = max_queue
    self.queue: collections.deque[Request] = collections.deque()
    self.slots: list[Request | None] = [None] * max_batch

  def submit(self, req: Request) -> None:
    """Queues `req`; raises QueueFull when `max_queue` requests wait already."""
    if len(self.queue) >= self.max_queue:
      raise QueueFull(f"{len(self.queue)} requests are waiting (--max-queue {self.max_queue})")
    self.queue.append(req)

  def active(self) -> list[Request]:
    """The requests holding a slot, in slot order."""
    return [r for r in self.slots if r is not None]

  def admit(self) -> list[Request]:
    """Moves waiting requests into free slots (FIFO) and returns the ones admitted now: they
    are prefilled before the next decode step and decode with the batch from then on."""
    admitted = []
    for i, r in enumerate(self.slots):
      if r is None and self.queue:
        req = self.queue.popleft()
        req.slot = i
        self.slots[i] = req
        admitted.append(req)
    return admitted

  def step(self, sampled: dict[int, tuple[int, str]]) -> list[Request]:
    """Records one step's output: `sampled` maps slot -> (token id, its decoded text). Returns
    the requests that finished with it; their slots are free for the next `admit`."""
    finished = []
    for slot, (tok, piece) in sampled.items():
      req = self.slots[slot]
      if req is None:
        continue
      if tok in req.eos_ids:
        req.finish_reason = "stop"
      else:
        req.tokens.append(tok)
        req.text += piece
        cut = _first_stop(req.text, req.stop)
        if cut is not None:
          req.text = req.text[:cut]
          req.finish_reason = "stop"
        elif len(req.tokens) >= req.max_tokens:
          req.finish_reason = "length"
      if req.done:
        self.slots[slot] = None
        finished.append(req)
    return finished

  def cancel(self, req: Request) -> None:
    """Drops `req` (client gone): out of the queue, or its slot freed."""
    if req in self.queue:
      self.queue.remove(req)
    elif req.slot is not None and self.slots[req.slot] is req:
      self.slots[req.slot] = None
    req.finish_reason = req.finish_reason or "cancelled"

  def idle(self) -> bool:
    return not self.queue and all(r is None for r in self.slots)


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
  """The index where the earliest stop string starts in `text`, or None."""
  hits = [i for s in stops if s and (i := text.find(s)) >= 0]
  return min(hits) if hits else None
