"""The server's listening sockets, bound before the model loads.

A busy --port or a --host that is not this machine's address is then the one-line error at once,
not after the model has loaded, and nothing else can take the port while it loads. The sockets
are bound as asyncio's create_server binds them for uvicorn (each address the host name resolves
to, SO_REUSEADDR, IPv6 sockets v6-only) and handed to uvicorn, which listens on them; a client
that connects before then is refused, as before. With --port 0 the system picks a free port
(one address only, so every socket has the same port); `port` says which.
"""

from __future__ import annotations

import errno
import socket

from jaxvt.errors import JaxvtError, escape


def bind(host: str, port: int) -> list[socket.socket]:
  """Sockets bound to every address of `host` at `port`, not yet listening; JaxvtError (one line
  naming --host/--port and the fix) where that cannot be done."""
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
  except socket.gaierror as e:
    raise JaxvtError(f"--host {escape(host, 80)} is not an address of this machine "
                     f"({escape(e.strerror, 80)}); pass one, e.g. --host 127.0.0.1") from None
  addresses = list(dict.fromkeys((family, proto, addr) for family, _, proto, _, addr in infos))
  if port == 0:
    addresses = addresses[:1]
  sockets: list[socket.socket] = []
  try:
    for family, proto, addr in addresses:
      sock = socket.socket(family, socket.SOCK_STREAM, proto)
      sockets.append(sock)
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
      sock.bind(addr)
  except OSError as e:
    for sock in sockets:
      sock.close()
    raise JaxvtError(_why(host, port, e)) from None
  return sockets


def port(sockets: list[socket.socket]) -> int:
  """The port the sockets are bound to (the system's pick for --port 0)."""
  return sockets[0].getsockname()[1]


def _why(host: str, port: int, e: OSError) -> str:
  where = f"{escape(host, 80)}:{port}"
  if e.errno == errno.EADDRINUSE:
    return (f"port {port} is in use on {escape(host, 80)} (another server listens there); pass "
            "another --port, or stop that server")
  if e.errno == errno.EACCES:
    return (f"no permission to listen on {where} (ports below 1024 need privileges); pass "
            "--port 1024 or above")
  if e.errno == errno.EADDRNOTAVAIL:
    return (f"--host {escape(host, 80)} is not an address of this machine; pass one, e.g. "
            "--host 127.0.0.1")
  return f"could not listen on {where} ({escape(e.strerror or e, 120)}); pass another --host or --port"
