"""python -m jaxvt.serve: one resident model behind an OpenAI-compatible API (uvicorn)."""

from __future__ import annotations

import contextlib
import logging
import signal

import uvicorn
from absl import app as absl_app
from absl import flags

from jaxvt import engine as engine_mod
from jaxvt.serve.app import build
from jaxvt.serve.loop import EngineLoop

flags.DEFINE_string("model", None, "GGUF file (default: the embedded SmolLM2)")
flags.DEFINE_integer("max_context", 2048, "tokens per request (prompt + output)")
flags.DEFINE_string("host", "127.0.0.1", "address to bind")
flags.DEFINE_integer("port", 8000, "port to bind")
flags.DEFINE_integer("max_batch", 8, "requests decoded together")
flags.DEFINE_integer("max_queue", 64, "requests waiting for a slot before 429")
F = flags.FLAGS


class _Server(uvicorn.Server):
  """uvicorn's server without its own signal capture, which re-raises SIGTERM after shutdown
  (exit status -15); our handlers set should_exit instead."""

  @contextlib.contextmanager
  def capture_signals(self):
    yield


def main(_):
  logging.basicConfig(level=logging.INFO)
  eng = engine_mod.load(F.model, max_context=F.max_context)
  loop = EngineLoop(eng, F.max_batch, F.max_queue)
  try:
    server = _Server(uvicorn.Config(build(eng, loop, F.model or "smollm2"), host=F.host,
                                    port=F.port, log_level="warning"))
    # SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish, then we exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    server.run()
  finally:
    loop.close()
    eng.close()


if __name__ == "__main__":
  absl_app.run(main)
