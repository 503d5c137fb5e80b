"""Bounds on what a client can hold on the server: a connection that never sends a request, a
stream nobody reads, a response the client left before it began.

- `GuardedH11`: uvicorn's h11 protocol with a deadline for a request's headers: a connection
  (new, or kept alive after a response) that has not sent a whole request head within
  `header_timeout` seconds is closed. uvicorn itself only times out a kept-alive connection
  once a byte arrives, never a new one, so a thousand silent connections would stay open.
- `SendTimeout`: ASGI middleware: one `send` of the response that waits longer than `seconds`
  for the client to take the bytes (a stream read slower than it is produced, once the socket
  and the transport's buffers are full) ends the response; the stream's generator is closed,
  which cancels its request in the engine loop.
- `wait_or_gone`: a non-streamed request's wait for its result that notices the client leaving
  (Starlette notices only once it writes), so a request that waits in the queue is cancelled;
  it listens on the ASGI `receive` that SendTimeout keeps in a context variable.

`uvicorn_options` gives the uvicorn.Config arguments of `python -m jaxvt.serve`'s flags.
"""

from __future__ import annotations

import asyncio
import contextvars

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's head
SEND_TIMEOUT = 60.0  # seconds one write of a response may wait for the client
_receive: contextvars.ContextVar = contextvars.ContextVar("jaxvt_receive", default=None)


class GuardedH11(H11Protocol):
  """H11Protocol that closes a connection without a whole request head after header_timeout."""

  header_timeout = HEADER_TIMEOUT

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    self._head_timer = self.loop.call_later(self.header_timeout, self._head_deadline)

  def on_response_complete(self) -> None:
    super().on_response_complete()
    self._head_timer.cancel()
    if not self.transport.is_closing():
      self._head_timer = self.loop.call_later(self.header_timeout, self._head_deadline)

  def connection_lost(self, exc) -> None:
    self._head_timer.cancel()
    super().connection_lost(exc)

  def _head_deadline(self) -> None:
    # their_state leaves IDLE once h11 has parsed a whole request head
    if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
      self.transport.close()


def guarded(header_timeout: float) -> type[GuardedH11]:
  """GuardedH11 with its own header timeout."""
  return type("GuardedH11", (GuardedH11,), {"header_timeout": header_timeout})


class SendTimeout:
  """ASGI middleware: a response's `send` that waits more than `seconds` raises TimeoutError
  (uvicorn then closes the connection; a StreamingResponse's generator is closed)."""

  def __init__(self, app, seconds: float = SEND_TIMEOUT):
    self.app, self.seconds = app, seconds

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)

    async def bounded(message):
      async with asyncio.timeout(self.seconds):  # no task per chunk, unlike wait_for
        await send(message)

    token = _receive.set(receive)
    try:
      return await self.app(scope, receive, bounded)
    finally:
      _receive.reset(token)


async def _disconnected(receive) -> None:
  """Returns once `receive` (whose request body has been read) says the client left."""
  while (await receive())["type"] != "http.disconnect":
    pass


async def wait_or_gone(q: asyncio.Queue, on_gone) -> bool:
  """Takes (piece, done) items from `q` until done: True. False where the HTTP request's client
  left first (its body already read), after calling on_gone(). Outside SendTimeout: q alone."""
  receive = _receive.get()
  gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
  try:
    while True:
      get = asyncio.ensure_future(q.get())
      done, _ = await asyncio.wait({get} | ({gone} if gone else set()),
                                   return_when=asyncio.FIRST_COMPLETED)
      if get not in done:
        get.cancel()
        on_gone()
        return False
      if get.result()[1]:
        return True
  finally:
    if gone is not None:
      gone.cancel()


def uvicorn_options(timeout_keep_alive: float, header_timeout: float,
                    limit_concurrency: int | None, max_incomplete: int) -> dict:
  """uvicorn.Config keyword arguments: the guarded h11 protocol, uvicorn's keep-alive timeout,
  its concurrency limit (connections or requests beyond it are answered 503), and the most bytes
  h11 buffers of an incomplete request head."""
  return {"http": guarded(header_timeout), "timeout_keep_alive": timeout_keep_alive,
          "limit_concurrency": limit_concurrency, "h11_max_incomplete_event_size": max_incomplete}
