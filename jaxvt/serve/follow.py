"""The server over several processes: process 0 decides, every process runs the same programs.

Process 0 owns HTTP, the scheduler and the engine loop (jaxvt.serve.loop). Its BatchSession is a
`LeaderSession`: before each device program (a prefill into a slot, a request's first token
starting its slot's penalty counts, a decode of the active slots, storing a finished slot for
prompt reuse, moving a slot) it broadcasts the call and its arguments
(which requests are in which slots, the tokens fed, the rows' sampling parameters, the admitted
prompts) to the other processes through `jax.experimental.multihost_utils.broadcast_one_to_all`,
then runs the program itself. The other processes run `follow`: they receive each call and make
it on a BatchSession of their own, so every process runs the same programs in the same order,
with the same prefix cache decisions (its store is a function of the calls). No socket of our own
carries anything.

A message is JSON: its length and a power-of-two bucket first (a fixed-shape broadcast), then its
bytes padded to the bucket (one compiled broadcast per bucket). While the server is idle process 0
sends a tick every TICK_S seconds, so a follower never waits in a collective longer than its
timeout allows. On shutdown process 0 sends "stop" and the followers return.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxvt.parallel import processes
from jaxvt.serve.batch import BatchSession

TICK_S = 5.0
MIN_BUCKET = 256


class Channel:
  """Process 0's messages (JSON-able values) to every process, in order."""

  def send(self, msg) -> None:
    """Process 0: broadcasts `msg`."""
    data = json.dumps(msg, separators=(",", ":"), default=_plain).encode()
    size = max(MIN_BUCKET, 1 << (len(data) - 1).bit_length())
    multihost_utils.broadcast_one_to_all(np.array([len(data), size], np.int64))
    buf = np.zeros(size, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    multihost_utils.broadcast_one_to_all(buf)

  def recv(self):
    """The other processes: the next message process 0 sends."""
    n, size = (int(x) for x in multihost_utils.broadcast_one_to_all(np.zeros(2, np.int64)))
    buf = multihost_utils.broadcast_one_to_all(np.zeros(size, np.uint8))
    return json.loads(bytes(np.asarray(buf[:n], np.uint8)))


def share(value, channel: Channel | None = None):
  """Process 0's `value` (JSON-able) in every process (a decision made once at start: the batch,
  the prefix cache's bytes)."""
  channel = channel or Channel()
  if jax.process_index() == 0:
    channel.send(value)
    return value
  return channel.recv()


def _replicated(session: BatchSession, logits: jax.Array) -> jax.Array:
  """`logits` replicated on every device of the session's mesh (a program every process runs),
  so process 0 reads them without another collective."""
  mesh = session.engine.ex.par.mesh
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return _copy_to(sharding)(logits)


_COPIES: dict = {}


def _copy_to(sharding):
  if sharding not in _COPIES:
    _COPIES[sharding] = jax.jit(lambda x: x, out_shardings=sharding)
  return _COPIES[sharding]


def _plain(x):
  """json.dumps' fallback: numpy scalars and arrays as Python values."""
  if isinstance(x, (np.generic, np.ndarray)):
    return x.tolist()
  raise TypeError(f"{type(x).__name__} is not JSON-able")


def _feed_json(feed: dict[int, tuple]) -> list:
  """decode's feed (slot -> (token, row parameters)) as JSON: a dict among the parameters (a
  logit bias, token id -> bias) as its pairs."""
  return [[int(s), int(t), [{"pairs": list(x.items())} if isinstance(x, dict) else x for x in p]]
          for s, (t, p) in feed.items()]


def _feed_of(items: list) -> dict[int, tuple]:
  return {s: (t, tuple({int(k): v for k, v in x["pairs"]} if isinstance(x, dict) else x
                       for x in p)) for s, t, p in items}


def _masks_json(masks: dict[int, np.ndarray] | None) -> list | None:
  """decode's token masks (slot -> packed int32 allowed-token bits) as JSON."""
  return None if not masks else [[int(s), np.asarray(m, np.int32).tolist()]
                                 for s, m in masks.items()]


def _masks_of(items: list | None) -> dict[int, np.ndarray] | None:
  return None if items is None else {s: np.asarray(m, np.int32) for s, m in items}


@contextlib.contextmanager
def _or_stop():
  """A collective that fails (another process is gone) stops this process with one line
  (processes.peer_failure), on whichever thread it ran."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    processes.peer_failure(e)
    raise


class LeaderSession(BatchSession):
  """Process 0's BatchSession: every device call broadcast first (module docstring); a thread
  sends ticks while the session is idle."""

  def __init__(self, engine, batch: int, prefix=None, channel: Channel | None = None):
    super().__init__(engine, batch, prefix)
    self.channel = channel or Channel()
    self._lock = threading.Lock()
    self._last = time.monotonic()
    self._closed = threading.Event()
    self._ticker = threading.Thread(target=self._tick, name="jaxvt-follow-tick", daemon=True)
    self._ticker.start()

  def _send(self, msg) -> None:
    self.channel.send(msg)
    self._last = time.monotonic()

  def _tick(self) -> None:
    while not self._closed.wait(TICK_S / 2):
      with self._lock, _or_stop():
        if not self._closed.is_set() and time.monotonic() - self._last >= TICK_S:
          self._send(["tick"])

  def prefill(self, slot, tokens):
    with self._lock, _or_stop():
      self._send(["prefill", int(slot), [int(t) for t in tokens]])
      logits, cached = super().prefill(slot, tokens)
      return np.asarray(_replicated(self, logits)), cached

  def finish(self, slot, tokens, exact=True):
    with self._lock, _or_stop():
      self._send(["finish", int(slot), [int(t) for t in tokens], bool(exact)])
      super().finish(slot, tokens, exact)

  def move(self, src, dst):
    with self._lock, _or_stop():
      self._send(["move", int(src), int(dst)])
      super().move(src, dst)

  def start(self, slot, token, penalized):
    with self._lock, _or_stop():
      self._send(["start", int(slot), int(token), bool(penalized)])
      super().start(slot, token, penalized)

  def dispatch(self, feed, steps=1, logprobs=False, masks=None, ahead=False):
    with self._lock, _or_stop():
      self._send(["decode", _feed_json(feed), int(steps), bool(logprobs), _masks_json(masks),
                  bool(ahead)])
      return super().dispatch(feed, steps, logprobs, masks=masks, ahead=ahead)

  def close(self) -> None:
    """Tells the followers to return (once)."""
    with self._lock:
      if not self._closed.is_set():
        self._closed.set()
        self._send(["stop"])


def follow(session: BatchSession, channel: Channel | None = None) -> None:
  """A process other than 0: makes process 0's session calls on `session` until "stop"."""
  channel = channel or Channel()
  while True:
    with _or_stop():
      if _follow_one(session, channel):
        return


def _follow_one(session: BatchSession, channel: Channel) -> bool:
  """Receives and makes one call; True at "stop"."""
  op, *args = channel.recv()
  if op == "prefill":
    logits, _ = session.prefill(*args)
    _replicated(session, logits).block_until_ready()
  elif op == "finish":
    session.finish(*args)
  elif op == "move":
    session.move(*args)
  elif op == "start":
    session.start(*args)
  elif op == "decode":
    feed, steps, logprobs, masks, ahead = args
    session.dispatch(_feed_of(feed), steps, logprobs, masks=_masks_of(masks), ahead=ahead)
  elif op not in ("tick", "stop"):
    raise ValueError(f"process 0 sent an unknown call {op!r}")
  return op == "stop"
