"""python -m jaxvt.serve: one resident model behind an OpenAI-compatible API (uvicorn).

It takes jaxvt.run's model and placement flags (jaxvt.cli), checks them before JAX starts, and
answers a mistake with one line on stderr and exit status 2. SIGTERM or Ctrl-C stops accepting
connections, lets the requests in flight finish (at most --drain-seconds), frees the host tier
and exits 0.

With --mesh it serves a model sharded over several devices; with --coordinator over several
processes, where process 0 owns HTTP and the scheduler and the others run the same device
programs (jaxvt.serve.follow)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys

from absl import flags

from jaxvt import cli, inputs, usage
from jaxvt.errors import JaxvtError, escape, out_of_memory

GiB = 1 << 30
LOOPBACK = ("127.0.0.1", "localhost", "::1")
USAGE = ("usage: python -m jaxvt.serve [--model PATH] [--offload-gb N|auto] [--port 8000] "
         "[flags...]")
SUMMARY = ("Keeps one GGUF model loaded and answers the OpenAI API (/v1/chat/completions, "
           "/v1/completions, /v1/models, /health) on --host:--port. Requests that arrive together "
           "are decoded together on the device, and a prompt that repeats an earlier one's start "
           "(a chat's next turn) prefills only what is new.")
EXAMPLES = (
    ("python -m jaxvt.serve", "the default model on http://127.0.0.1:8000/v1"),
    ("python -m jaxvt.serve --model big.gguf --offload-gb 7 --max-batch 8",
     "7 GiB of weights in the host tier, 8 requests decoded together"),
    ("python -m jaxvt.serve --host 0.0.0.0 --api-key $KEY",
     "on every interface; every request needs Authorization: Bearer $KEY"),
)
GROUPS = (
    ("model and placement", ("model", "max_context", "offload_gb", "offload_pattern",
                             "device_gb", "expert_cache_gb", "expert_cache_policy", "force",
                             "mesh", "coordinator", "num_processes", "process_id",
                             "join_timeout")),
    ("server", ("host", "port", "api_key", "max_batch", "max_queue", "prefix_cache_gb",
                "drain_seconds")),
    ("connections", ("header_timeout", "timeout_keep_alive", "send_timeout",
                     "limit_concurrency")),
    ("runtime", ("numerics", "batch_invariant", "deterministic", "compile_cache", "verbose",
                 "help", "helpfull", "version")),
)

FLAGS = flags.FlagValues()
cli.define_model_flags(FLAGS)
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on; anything but loopback is "
                    "reachable from the network (pair it with --api-key).", flag_values=FLAGS)
flags.DEFINE_integer("port", 8000, "Port to listen on.", flag_values=FLAGS)
flags.DEFINE_string("api_key", None, "Every /v1 request must send Authorization: Bearer KEY.",
                    flag_values=FLAGS)
flags.DEFINE_integer("max_batch", None, "Requests decoded together (default: what the device "
                     "memory beside the plan holds, at most 8).", flag_values=FLAGS)
flags.DEFINE_integer("max_queue", 64, "Requests that may wait for a free slot; one more gets "
                     "429 with Retry-After.", flag_values=FLAGS)
flags.DEFINE_float("prefix_cache_gb", None, "Device GiB for earlier prompts' states, reused by "
                   "the prompts that start the same way (default: what the batch leaves; 0: off).",
                   flag_values=FLAGS)
flags.DEFINE_float("drain_seconds", 30.0, "On SIGTERM, how long requests in flight may take to "
                   "finish before the server exits anyway.", flag_values=FLAGS)
flags.DEFINE_float("header_timeout", 10.0, "Seconds a connection may take to send a request's "
                   "headers (a new one, or one kept alive after a response) before it is closed.",
                   flag_values=FLAGS)
flags.DEFINE_float("timeout_keep_alive", 5.0, "Seconds an idle kept-alive connection stays open "
                   "(uvicorn's).", flag_values=FLAGS)
flags.DEFINE_float("send_timeout", 60.0, "Seconds one write of a response may wait for a client "
                   "that does not read (a stalled stream) before the response is ended.",
                   flag_values=FLAGS)
flags.DEFINE_integer("limit_concurrency", None, "Open connections and requests at most; beyond "
                     "it requests get 503 (default: no limit but the process's open files).",
                     flag_values=FLAGS)
cli.define_info_flags(FLAGS)
log = logging.getLogger("jaxvt.serve")
MAX_INCOMPLETE = 64 << 10  # bytes h11 buffers of a request head at most


def _help(full: bool) -> str:
  return usage.help_text(FLAGS, full, usage=USAGE, summary=SUMMARY, examples=EXAMPLES,
                         groups=GROUPS)


def _parse(argv: list[str]) -> int | None:
  """Parses argv into FLAGS; an exit status where the command has answered already."""
  try:
    FLAGS.unparse_flags()
    rest = FLAGS(cli.normalize_argv(argv))[1:]
  except flags.Error as e:
    if any(a in usage.HELP_FLAGS for a in argv[1:]):
      sys.stdout.write(_help("--helpfull" in argv[1:]))
      return 0
    if isinstance(e, flags.UnrecognizedFlagError):
      print(f"jaxvt: error: {usage.unknown_flag(e, FLAGS)}", file=sys.stderr)
    else:
      print(f"jaxvt: error: {escape(e, 2000)}; see --help", file=sys.stderr)
    return 2
  if FLAGS.help or FLAGS.helpfull:
    sys.stdout.write(_help(FLAGS.helpfull))
    return 0
  if FLAGS.version:
    sys.stdout.write(usage.version_text())
    return 0
  if rest:
    print(f"jaxvt: error: the server takes no arguments, got {escape(' '.join(rest), 80)}; "
          "see --help", file=sys.stderr)
    return 2
  return None


def _validate(F) -> None:
  cli.validate_model_flags(F)
  inputs.whole("--port", F.port, 0, 65535)
  inputs.whole("--max-queue", F.max_queue, 0, 1 << 20)
  if F.max_batch is not None:
    inputs.whole("--max-batch", F.max_batch, 1, 1 << 10)
  if F.prefix_cache_gb is not None:
    inputs.number("--prefix-cache-gb", F.prefix_cache_gb, lo=0.0, hi=inputs.MAX_GIB)
  inputs.number("--drain-seconds", F.drain_seconds, lo=0.0, hi=86400.0)
  inputs.number("--header-timeout", F.header_timeout, lo=0.1, hi=86400.0)
  inputs.number("--timeout-keep-alive", F.timeout_keep_alive, lo=0.1, hi=86400.0)
  inputs.number("--send-timeout", F.send_timeout, lo=0.1, hi=86400.0)
  if F.limit_concurrency is not None:
    inputs.whole("--limit-concurrency", F.limit_concurrency, 1, 1 << 20)
  if F.api_key is not None and not F.api_key:
    raise JaxvtError("--api-key is empty; pass a key, or leave the flag out")


def _serve(F) -> int:
  from jaxvt.parallel import guard
  from jaxvt.serve import listen
  # Only process 0 owns HTTP (over several processes, its guarded child, which serves while its
  # parent supervises); a busy port is refused before the model loads.
  http = F.process_id == 0 and (F.coordinator is None or guard.guarded())
  sockets = listen.bind(F.host, F.port) if http else []
  try:
    return _serve_on(F, sockets)
  finally:
    for sock in sockets:
      sock.close()


def _serve_on(F, sockets) -> int:
  import uvicorn

  from jaxvt import engine as engine_mod
  from jaxvt.offload import expert_cache
  from jaxvt.offload.memory import ServeMemory, serve_memory
  from jaxvt.prefix import PrefixCache, sequence_bytes
  from jaxvt.serve import listen
  from jaxvt.serve.app import build
  from jaxvt.serve.batch import BatchSession
  from jaxvt.serve.limits import uvicorn_options
  from jaxvt.serve.loop import EngineLoop

  class Server(uvicorn.Server):
    """uvicorn's server without its own signal capture, which re-raises SIGTERM after shutdown
    (exit status -15); our handlers set should_exit instead. `ready` runs once it listens."""
    ready = staticmethod(lambda: None)

    @contextlib.contextmanager
    def capture_signals(self):
      yield

    async def startup(self, sockets=None):
      await super().startup(sockets)
      if self.started:
        self.ready()

  if F.host not in LOOPBACK and F.api_key is None:
    print(f"jaxvt: warning: listening on {escape(F.host, 80)} with no authentication: anyone "
          "who can reach this port can use the model; pass --api-key KEY", file=sys.stderr)
  from jaxvt.gguf.default_model import default_model_path
  status = cli.join_processes(F, "jaxvt.serve", F.model or default_model_path(),
                              dict(max_batch=F.max_batch, prefix_cache_gb=F.prefix_cache_gb))
  if status is not None:  # this process guarded the one that served
    return status
  several = F.coordinator is not None
  opts = cli.load_options(F)
  cache_gb, policy = opts.pop("expert_cache_gb"), opts.pop("expert_cache_policy")
  # the expert cache takes what the batch and the prefix cache leave, so it comes after them
  def show_plan(placed):
    print(placed.report(), file=sys.stderr)
    if several:
      from jaxvt.parallel import processes
      print(processes.describe(placed.devices), file=sys.stderr)

  eng = engine_mod.load(F.model, on_plan=show_plan, expert_cache_gb=0, **opts)
  try:
    mem = None
    if F.process_id == 0:
      mem = serve_memory(eng.plan.breakdown, sequence_bytes(eng), F.max_batch,
                         None if F.prefix_cache_gb is None else int(F.prefix_cache_gb * GiB))
    if several:  # process 0's figures in every process (each measured its own free memory)
      from jaxvt.serve import follow
      mem = ServeMemory(**follow.share(None if mem is None else dataclasses.asdict(mem)))
    placed = eng.plan.with_expert_cache(cache_gb, policy, F.force, free=mem.left)
    if placed.expert_cache is not None:
      eng.weights = expert_cache.attach(eng.weights, placed.expert_cache, eng.ex.par)
      eng.memory = placed.breakdown
      print(f"jaxvt: {placed.expert_cache.describe()}", file=sys.stderr)
    prefix = PrefixCache(eng, mem.prefix_bytes) if mem.prefix_bytes else None
    if several and F.process_id != 0:  # the same programs as process 0, no HTTP
      follow.follow(BatchSession(eng, mem.batch, prefix))
      return 0
    session = follow.LeaderSession(eng, mem.batch, prefix) if several else None
    loop = EngineLoop(eng, mem.batch, F.max_queue, prefix, session=session)
    said = (f"jaxvt: serving {escape(eng.path, 200)} on http://{escape(F.host, 80)}:"
            f"{listen.port(sockets)}/v1: {mem.batch} sequences decoded together, "
            f"{mem.prefix_bytes / GiB:.2f} GiB for prompt reuse")
    info = {"batch": mem.batch, "sequence_bytes": mem.sequence_bytes,
            "prefix_bytes": mem.prefix_bytes, "max_context": eng.max_context}
    app = build(eng, loop, _model_id(F), F.api_key, info, send_timeout=F.send_timeout)
    server = Server(uvicorn.Config(app, host=F.host, port=F.port, log_level="warning",
                                   timeout_graceful_shutdown=F.drain_seconds,
                                   **uvicorn_options(F.timeout_keep_alive, F.header_timeout,
                                                     F.limit_concurrency, MAX_INCOMPLETE)))
    server.ready = lambda: print(said, file=sys.stderr, flush=True)
    # SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish, then we exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    try:
      server.run(sockets=sockets)
    finally:
      loop.close(F.drain_seconds)
      if session is not None:
        session.close()  # the other processes return
  finally:
    eng.close()
  if not server.started:
    raise JaxvtError(f"could not listen on {F.host}:{F.port} (in use, or not this machine's "
                     "address); pick another --port or --host")
  return 0


def _model_id(F) -> str:
  return os.path.basename(F.model) if F.model else "smollm2-135m-instruct"


def main(argv: list[str]) -> int:
  status = _parse(argv)
  if status is not None:
    return status
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("jaxvt: %(message)s"))
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False
  with cli.quiet(FLAGS.verbose):
    try:
      _validate(FLAGS)
      return _serve(FLAGS)
    except Exception as e:  # pylint: disable=broad-except  (re-raised unless it is the user's)
      error = e if isinstance(e, JaxvtError) else out_of_memory(e)
      if error is None and FLAGS.coordinator is not None:  # another process is gone
        from jaxvt.parallel import processes
        processes.peer_failure(e)
      if error is None:
        raise
      print(f"jaxvt: error: {error}", file=sys.stderr)
      return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv))
