"""A pure continuous-batching scheduler: no model, no device, no threads.

The engine loop asks it, before each device program, which queued requests join the batch
(`admit`), feeds it each step's sampled token per active slot (`step`), and it says which
requests finished (eos, a stop string, max_tokens) and frees their slots. Requests that arrive
while others decode wait in a bounded FIFO queue and take the next free slot; a request that
finds neither a free slot nor room in the queue is refused at once (`QueueFull`: the server
answers 429 with Retry-After). Text is released to a stream (`Request.release`) only where no
stop string can still begin, so a streamed answer never shows the start of a stop string.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Callable


class QueueFull(Exception):
  """The wait queue holds `max_queue` requests already."""


@dataclasses.dataclass
class Request:
  """One generation: its prompt token ids and how it ends."""
  prompt: list[int]
  max_tokens: int
  eos_ids: frozenset[int] = frozenset()
  stop: tuple[str, ...] = ()
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)  # added to the logits
  frequency_penalty: float = 0.0  # OpenAI's penalties (jaxvt.sampling.penalize)
  presence_penalty: float = 0.0
  logprobs: int | None = None  # alternatives reported per token; None: no logprobs
  # The chat fields a constrained decoder acts on, as validated (jaxvt.serve.schema), as dicts.
  response_format: dict | None = None
  tools: list[dict] | None = None
  tool_choice: str | dict | None = None
  parallel_tool_calls: bool = True
  id: int = dataclasses.field(default_factory=itertools.count().__next__)
  tokens: list[int] = dataclasses.field(default_factory=list)
  # with `logprobs`, one per token of `tokens`: (its log-probability, [(token id, log-probability)
  # of the `logprobs` most likely])
  token_logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(
      default_factory=list)
  text: str = ""
  finish_reason: str | None = None  # "stop" | "length" | "cancelled" once done
  slot: int | None = None
  cached: int = 0  # prompt tokens taken from the prefix cache, not computed
  sent: int = 0  # characters of `text` released so far
  eos: bool = False  # ended by an end-of-generation token (not part of `tokens`)
  decoder: Any = None  # the engine loop's incremental detokenizer (push(id) -> text)
  listener: Callable[["Request"], None] | None = None  # told of new text and of the end

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def fed(self) -> list[int]:
    """The tokens its cache holds once it is done: the prompt and every generated token fed
    back (the last one sampled at max_tokens never is)."""
    out = self.tokens if self.eos else self.tokens[:-1]
    return self.prompt + out

  def release(self) -> str:
    """The text not released yet that no stop string can still cut (all of it once done)."""
    end = len(self.text) - (0 if self.done else _stop_start(self.text, self.stop))
    piece = self.text[self.sent:end] if end > self.sent else ""
    self.sent += len(piece)
    return piece


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
    """Queues `req`; raises QueueFull when it would wait behind `max_queue` requests already
    waiting (requests that the free slots take at the next admission do not wait)."""
    free = sum(r is None for r in self.slots)
    if len(self.queue) >= self.max_queue + free:
      raise QueueFull(f"{len(self.queue)} requests are waiting for {self.max_batch} slots "
                      f"(--max-queue {self.max_queue}); retry later")
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
        req.finish_reason, req.eos = "stop", True
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

  def compact(self) -> list[tuple[int, int]]:
    """Keeps the active requests in slots 0..n-1 (a decode step then runs the first n slots
    only): moves the highest active request into each free slot below it. Returns the moves,
    (from slot, to slot), in order; the caller moves the caches the same way."""
    moves = []
    while True:
      free = next((i for i, r in enumerate(self.slots) if r is None), None)
      last = max((i for i, r in enumerate(self.slots) if r is not None), default=None)
      if free is None or last is None or last < free:
        return moves
      req = self.slots[last]
      self.slots[free], self.slots[last], req.slot = req, None, free
      moves.append((last, free))

  def cancel(self, req: Request) -> None:
    """Drops `req` (client gone): out of the queue, or its slot freed."""
    if req in self.queue:
      self.queue.remove(req)
    elif req.slot is not None and self.slots[req.slot] is req:
      self.slots[req.slot] = None
    req.finish_reason = req.finish_reason or "cancelled"

  def idle(self) -> bool:
    return not self.queue and all(r is None for r in self.slots)


def _stop_start(text: str, stops: tuple[str, ...]) -> int:
  """The length of the longest end of `text` that begins some stop string (which the next
  tokens may complete)."""
  held = 0
  for s in stops:
    for k in range(min(len(s) - 1, len(text)), held, -1):
      if text.endswith(s[:k]):
        held = k
        break
  return held


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
  """The index where the earliest stop string starts in `text`, or None."""
  hits = [i for s in stops if s and (i := text.find(s)) >= 0]
  return min(hits) if hits else None
