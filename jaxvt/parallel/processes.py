"""A run over several processes (one per host, or several on one machine): joining them through
JAX's distributed runtime, checking that they run the same thing, and stopping all of them when
one fails.

`start` is what `--coordinator/--num-processes/--process-id` do, before anything else touches
JAX's backends:

  1. process 0 checks that the coordinator's port is free (a port in use is one line, not
     JAX's abort);
  2. the coordination service and its client start with bounded waits: connecting waits at most
     `timeout` seconds for every process (an unreachable coordinator, a mismatched
     --num-processes, a process that never starts: one line each), and a process whose
     heartbeats stop for HEARTBEAT_S seconds is declared dead, upon which the runtime aborts the
     others (jaxvt.parallel.guard turns that abort into one line), so when any process fails or
     is killed the others stop within about HEARTBEAT_S seconds (SIGTERM to process 0 stops all
     of them the same way); a collective that fails because its peer is gone is one line too
     (`peer_failure`);
  3. the backend starts (CPU: collectives over gloo), with C++'s stdout on stderr (jaxvt.parallel
     .voice);
  4. every process publishes a digest of its model file and of the flags that shape the device
     programs (the coordination service's key-value store) and compares it with process 0's:
     different files or flags are one line in every process, not a hang in the first collective.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import socket
import sys

import jax

from jaxvt.errors import JaxvtError, escape
from jaxvt.parallel import guard

HEARTBEAT_S = 10  # a process silent this long is dead; the others stop
SAMPLES = 16  # pieces of the model file hashed besides its header
SAMPLE_BYTES = 1 << 16
HEADER_BYTES = 1 << 22
EXIT_PEER = 1  # status of a process stopped because another one failed
_ME = [0]  # this process's id, for the failure line (which may come from another thread)


def split_address(coordinator: str) -> tuple[str, int]:
  """(host, port) of --coordinator HOST:PORT ([::1]:PORT for IPv6); JaxvtError otherwise."""
  host, _, port = (coordinator or "").rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise JaxvtError(f"--coordinator {escape(coordinator, 80)!s} must be HOST:PORT of process 0 "
                     "(PORT in 1..65535)")
  return host.strip("[]"), int(port)


def _loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def check_port(coordinator: str) -> str:
  """Process 0: JaxvtError when the coordinator's port is taken on this machine. Returns the
  address the coordination service binds: the given one where it is loopback (nothing beyond
  this machine can reach it), else every interface on that port, as jax.distributed does."""
  host, port = split_address(coordinator)
  bind = host if _loopback(host) else "::"
  family = socket.AF_INET6 if ":" in bind else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    try:
      s.bind((bind if bind != "localhost" else "127.0.0.1", port))
    except OSError as e:
      raise JaxvtError(f"--coordinator {escape(coordinator, 80)}: port {port} is in use or not "
                       f"this machine's ({e.strerror}); pick a free port for process 0") from None
  return f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"


def _stop(why: str) -> None:
  """One line on stderr, exit status EXIT_PEER at once (no atexit: JAX's distributed shutdown
  would wait for the process that is gone)."""
  why = escape(why, 300).strip().splitlines()
  why = why[0] if why else "no reason given"
  try:
    sys.stdout.flush()
  except Exception:  # pylint: disable=broad-except  (exiting anyway)
    pass
  os.write(2, (f"jaxvt: error: process {_ME[0]} stops: another process of the run failed or "
               f"stopped answering ({why})\n").encode())
  os._exit(EXIT_PEER)


def peer_failure(error: BaseException) -> None:
  """An exception out of a device program of a run over several processes that is not jaxvt's
  own: a collective failed because another process is gone (gloo: "Connection reset by peer"),
  or XLA failed in a way every process sees. One line, exit status EXIT_PEER."""
  if isinstance(error, jax.errors.JaxRuntimeError):
    _stop(str(error))


def initialize(coordinator: str, num_processes: int, process_id: int, timeout: int) -> None:
  """JAX's distributed runtime over `num_processes` processes with bounded waits and a one-line
  failure (module docstring). Starts the service in process 0; JaxvtError where connecting
  fails."""
  # jax.distributed.initialize binds every interface, waits 300 s and installs the preemption
  # handler on SIGTERM; its State, service and client are driven here with our own settings
  from jax._src import distributed as dist
  from jax._src.lib import _jax
  if not 0 <= process_id < num_processes:
    raise JaxvtError(f"--process-id {process_id} must be in 0..{num_processes - 1} "
                     f"(--num-processes {num_processes})")
  bind = check_port(coordinator) if process_id == 0 else None
  state = dist.global_state
  if state.client is not None:
    raise JaxvtError("this process has joined a distributed run already")
  if process_id == 0:
    state.service = _jax.get_distributed_runtime_service(
        bind, num_processes, heartbeat_timeout=HEARTBEAT_S, shutdown_timeout=HEARTBEAT_S)
  state.process_id, state.num_processes = process_id, num_processes
  _ME[0] = process_id
  state.coordinator_address = coordinator
  state.client = _jax.get_distributed_runtime_client(
      coordinator, process_id, init_timeout=timeout, heartbeat_timeout=HEARTBEAT_S,
      shutdown_timeout=HEARTBEAT_S, use_compression=True)
  try:
    state.client.connect()
  except Exception as e:  # pylint: disable=broad-except  (JAX's error is one more traceback)
    raise JaxvtError(
        f"process {process_id} could not join the run at {escape(coordinator, 80)} within "
        f"{timeout} s: process 0 not reachable there, or not every one of the "
        f"{num_processes} processes started with the same --coordinator and --num-processes "
        f"({escape(str(e).splitlines()[0] if str(e) else type(e).__name__, 200)})") from None
  # No preemption sync manager (jax.distributed's default): it takes SIGTERM over, and SIGTERM
  # must stop the process (and with it the run).
  guard.mark_joined()


def start_backend() -> list:
  """Starts JAX's backend (every process's devices; on CPU, collectives over gloo) and returns
  jax.devices()."""
  return jax.devices()


def file_digest(path: str) -> str:
  """A digest of a model file that copies on different hosts share: its size, its first
  HEADER_BYTES (the metadata and the tensor table) and SAMPLES pieces spread over the rest."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    h.update(str(size).encode())
    h.update(f.read(HEADER_BYTES))
    for i in range(SAMPLES):
      f.seek(HEADER_BYTES + (size - HEADER_BYTES) * i // SAMPLES if size > HEADER_BYTES else 0)
      h.update(f.read(SAMPLE_BYTES))
  return h.hexdigest()[:16]


def agree(what: dict, timeout: int) -> None:
  """Every process's `what` (the model file's digest and the flags that shape the programs)
  equals process 0's; JaxvtError naming the first difference otherwise. Through the
  coordination service's key-value store, before any collective could hang on a mismatch."""
  from jax._src import distributed as dist
  client, me, n = dist.global_state.client, jax.process_index(), jax.process_count()
  mine = json.dumps(what, sort_keys=True)
  client.key_value_set(f"jaxvt/start/{me}", mine)
  ms = timeout * 1000
  for other in range(n):
    if other == me:
      continue
    try:
      theirs = json.loads(client.blocking_key_value_get(f"jaxvt/start/{other}", ms))
    except Exception:  # pylint: disable=broad-except
      raise JaxvtError(f"process {other} did not say what it runs within {timeout} s; start "
                       "every process with the same command") from None
    diff = sorted(k for k in set(what) | set(theirs) if what.get(k) != theirs.get(k))
    if diff:
      k = diff[0]
      raise JaxvtError(f"process {other} runs with {k} {escape(str(theirs.get(k)), 120)} where "
                       f"process {me} has {escape(str(what.get(k)), 120)}; run every process "
                       "with the same model file and flags (only --process-id differs)")


def describe(mesh_devices: int) -> str:
  """The plan report's line for a run over several processes."""
  n, local = jax.process_count(), jax.local_device_count()
  used = min(local, mesh_devices)
  return (f"  processes: {n}, each placing its own {used} of the mesh's {mesh_devices} devices; "
          "the figures above are each device's, and each process keeps its own host tier and "
          "expert cache")


def start(coordinator: str, num_processes: int, process_id: int, *, timeout: int,
          verbose: bool, model_path: str | None, flags: dict) -> None:
  """The steps of the module docstring, for a CLI run: voice, runtime, backend, agreement.
  `flags`: the values (JSON-able) every process must share."""
  from jaxvt.parallel import voice
  voice.setup(process_id, verbose)
  initialize(coordinator, num_processes, process_id, timeout)
  start_backend()
  what = dict(flags, num_processes=num_processes, devices_per_process=jax.local_device_count())
  if model_path is not None:
    what["model file"] = file_digest(model_path)
  agree(what, timeout)
  sys.stdout.flush()
