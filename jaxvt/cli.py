"""What the command-line tools share (python -m jaxvt.run, python -m jaxvt.serve): the flags that
choose the model and its placement, their checks before JAX starts, --max-tokens spelled with
dashes, the loading bar, and the quiet mode that keeps XLA's and JAX's logs off the terminal.

This module imports nothing heavy: a bad flag is answered before JAX starts."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

from absl import flags

from jaxvt import inputs
from jaxvt.errors import JaxvtError, JaxvtWarning, escape


def define_model_flags(fv: flags.FlagValues) -> None:
  """--model, the placement flags (--max-context, --offload-gb, --offload-pattern, --device-gb,
  --mesh, the several-host flags, --force), --numerics, --deterministic, --batch-invariant,
  --compile-cache and --verbose."""
  flags.DEFINE_string("model", None, "GGUF file to run (default: the embedded SmolLM2-135M-Instruct "
                      "Q4_1).", flag_values=fv)
  flags.DEFINE_integer("max_context", inputs.DEFAULT_CONTEXT, "Context length to allocate "
                       "(prompt + generation), at most the model's trained context (default: "
                       f"{inputs.DEFAULT_CONTEXT}, or the trained context where that is shorter).",
                       flag_values=fv)
  flags.DEFINE_string("offload_gb", "0", "GiB of weights to keep in the pinned host tier, read in "
                      "place by the kernels; 'auto' picks the best safe budget. With --mesh, per "
                      "device (as vLLM's --cpu-offload-gb).", flag_values=fv)
  flags.DEFINE_multi_string("offload_pattern", [], "Put the weights whose label "
                            "('blk.3.moe.w_up') or GGUF name ('blk.3.ffn_up_exps.weight') matches "
                            "REGEX in that tier (host when no kind is given); repeat the flag for "
                            "several patterns. Forced host bytes count against --offload-gb.",
                            flag_values=fv)
  flags.DEFINE_float("device_gb", None, "Behave as if the device (each device of --mesh) had this "
                     "many GiB.", flag_values=fv)
  flags.DEFINE_string("mesh", None, "Shard the model over local devices: 'tp=N' (attention heads, "
                      "FFN columns, experts), 'ep=N' (experts only), or 'tp=N,ep=M'.",
                      flag_values=fv)
  flags.DEFINE_string("coordinator", None, "Several hosts: HOST:PORT of process 0 "
                      "(jax.distributed.initialize); with --num-processes and --process-id.",
                      flag_values=fv)
  flags.DEFINE_integer("num_processes", 1, "Several hosts: how many processes (one per host).",
                       flag_values=fv)
  flags.DEFINE_integer("process_id", 0, "Several hosts: this process's index.", flag_values=fv)
  flags.DEFINE_integer("join_timeout", 120, "Several hosts: seconds to wait for every process to "
                       "join the coordinator (and to say what it runs) before giving up.",
                       flag_values=fv)
  flags.DEFINE_string("expert_cache_gb", "auto", "GiB of device memory that keeps the routed "
                      "experts recent tokens used from the host tier, so decode reads them from "
                      "the device; 'auto' takes what the plan leaves free, 0 turns it off.",
                      flag_values=fv)
  flags.DEFINE_enum("expert_cache_policy", "lru", ["lru", "lfru"], "Which experts the expert "
                    "cache evicts: the least recently used (lru) or the least used lately "
                    "(lfru: a use count decayed by 1/8 a token).", flag_values=fv)
  flags.DEFINE_boolean("force", False, "Run a budget the planner calls unsafe.", flag_values=fv)
  flags.DEFINE_boolean("deterministic", None, "Compile with XLA's algorithm choices fixed, so every "
                       "run and every --offload-gb gives the same tokens (default: on; "
                       "JAXVT_DETERMINISTIC=0 turns it off).", flag_values=fv)
  flags.DEFINE_enum("numerics", None, ["ggml", "llamacpp", "f32", "q8"], "The arithmetic "
                    "(docs/NUMERICS.md). Default: ggml on the CPU, where a request's tokens do "
                    "not depend on how it was scheduled (alone, batched, after a prefix-cache "
                    "hit; no measurable cost); q8 on GPUs. llamacpp: llama.cpp's CPU logits "
                    "bit for bit, prompt and decode, but a prefix-cache hit or a batch may then "
                    "change a near-tie token.", flag_values=fv)
  flags.DEFINE_boolean("batch_invariant", False, "On GPUs, kernels whose arithmetic for a "
                       "request never depends on what else its device program holds, so greedy "
                       "and seeded tokens are the same alone, batched with other requests, after a "
                       "prefix-cache hit or cold (as vLLM's batch-invariant mode). It costs speed: "
                       "on an H100, decode at 0.88-0.89x and a prompt's prefill at 0.10x "
                       "(docs/BENCHMARKS.md). On the CPU the default arithmetic already is "
                       "invariant, and the flag changes nothing.", flag_values=fv)
  flags.DEFINE_boolean("compile_cache", None, "Keep compiled programs in JAX's persistent cache "
                       "under $XDG_CACHE_HOME/jaxvt or ~/.cache/jaxvt (default: on; "
                       "JAXVT_COMPILE_CACHE=0 turns it off, =DIR moves it).", flag_values=fv)
  flags.DEFINE_boolean("verbose", False, "Also show what XLA and JAX log (compiler messages, their "
                       "warnings); by default only jaxvt's own lines reach stderr.", short_name="v",
                       flag_values=fv)


def define_info_flags(fv: flags.FlagValues) -> None:
  """--help (-h), --helpfull and --version: answered without starting JAX (jaxvt.usage)."""
  flags.DEFINE_boolean("help", False, "Print this help and exit.", short_name="h", flag_values=fv)
  flags.DEFINE_boolean("helpfull", False, "Print this help and the environment variables jaxvt "
                       "reads, and exit.", flag_values=fv)
  flags.DEFINE_boolean("version", False, "Print the versions of jaxvt, jax and jaxlib and the "
                       "extension's build, and exit (JAX is not started).", flag_values=fv)


def validate_model_flags(F) -> float | str:
  """Checks define_model_flags' flags with the checks the Python API makes (jaxvt.inputs);
  returns --offload-gb parsed (GiB or "auto")."""
  inputs.max_context(F.max_context, cli=True)
  inputs.device_gb(F.device_gb, cli=True)
  offload = inputs.offload_gb(F.offload_gb, cli=True)
  if F.model is not None and not F.model:
    raise JaxvtError("--model is empty; pass --model PATH to a .gguf file (or leave it out for "
                     "the default model)")
  if F.offload_pattern:
    from jaxvt.offload.plan import parse_overrides
    parse_overrides(F.offload_pattern)
  if F.mesh is not None:
    from jaxvt.parallel import mesh
    mesh.parse(F.mesh)
  if F.coordinator is None and (F.num_processes != 1 or F.process_id != 0):
    raise JaxvtError("--num-processes / --process-id need --coordinator HOST:PORT")
  inputs.processes(F.num_processes, F.process_id, cli=True)
  inputs.whole("--join-timeout", F.join_timeout, 1, 86400)
  if F.coordinator is not None:
    from jaxvt.parallel.processes import split_address
    split_address(F.coordinator)
  inputs.expert_cache_gb(F.expert_cache_gb, cli=True)
  return offload


def max_context(F) -> int | None:
  """--max-context where the user gave it; None leaves the default to the model
  (inputs.context_for)."""
  return F.max_context if F["max_context"].present else None


def join_processes(F, module: str, model_path: str | None, program_flags: dict) -> int | None:
  """With --coordinator: this process joins the run over several processes
  (jaxvt.parallel.processes.start), checking that every process has the same model file and
  `program_flags` (the flags that shape the device programs, besides define_model_flags').
  Unguarded, it instead runs `python -m module` (this command) as its guarded child
  (jaxvt.parallel.guard) and returns the status to exit with."""
  if F.coordinator is None:
    return None
  from jaxvt.parallel import guard
  if not guard.guarded():
    return guard.supervise(module, sys.argv, F.process_id, F.coordinator, F.join_timeout)
  from jaxvt.parallel import processes
  shared = {k: F[k].value for k in ("max_context", "offload_gb", "offload_pattern", "device_gb",
                                    "mesh", "expert_cache_gb", "expert_cache_policy", "force",
                                    "deterministic", "batch_invariant", "model")}
  shared["model"] = os.path.basename(shared["model"] or "")
  processes.start(F.coordinator, F.num_processes, F.process_id, timeout=F.join_timeout,
                  verbose=F.verbose, model_path=model_path, flags={**shared, **program_flags})
  return None


def load_options(F) -> dict:
  """jaxvt.load's keyword arguments from define_model_flags' flags (checked already)."""
  from jaxvt import programs
  deterministic = (F.deterministic if F.deterministic is not None else
                   programs.env_flag(os.environ, "JAXVT_DETERMINISTIC"))
  cache = F.compile_cache  # None: JAXVT_COMPILE_CACHE or the default directory
  if cache:  # on even where the environment says off; in its directory if it names one
    cache = programs.cache_root(None, os.environ) or True
  return dict(max_context=max_context(F), offload_gb=inputs.offload_gb(F.offload_gb),
              device_gb=F.device_gb, force=F.force, mesh=F.mesh,
              offload_pattern=tuple(F.offload_pattern), deterministic=deterministic,
              compile_cache=cache, expert_cache_gb=inputs.expert_cache_gb(F.expert_cache_gb),
              expert_cache_policy=F.expert_cache_policy, numerics=F.numerics,
              batch_invariant=F.batch_invariant)


class Bar:
  """A progress bar on stderr while weights load; silent where stderr is not a terminal (a log
  gets no redraws: the load line after it says how long loading took)."""

  def __init__(self, total: int, tty: bool | None = None):
    self.total, self.done, self.shown = max(total, 1), 0, -1
    if not (sys.stderr.isatty() if tty is None else tty):
      self.shown = -2

  def __call__(self, nbytes: int) -> None:
    self.done += nbytes
    if self.shown == -2:
      return
    pct = min(100, int(100 * self.done / self.total))
    if pct != self.shown:
      self.shown = pct
      bar = "#" * (pct // 4)
      sys.stderr.write(f"\rloading weights [{bar:<25}] {pct:3d}%")
      if pct == 100:
        self.finish()
      sys.stderr.flush()

  def finish(self, done: bool = False) -> None:
    """Ends the bar's line (once), so what follows starts on a line of its own; `done`: the
    load finished, so the bar shows 100% (weights a run does not place, such as an MTP block,
    never reach it)."""
    if done and 0 <= self.shown < 100:
      sys.stderr.write(f"\rloading weights [{'#' * 25}] 100%")
    if self.shown >= 0 and self.shown != -2:
      sys.stderr.write("\n")
      sys.stderr.flush()
    self.shown = -2



def normalize_argv(argv: list[str]) -> list[str]:
  """Accepts --max-tokens as well as absl's --max_tokens spelling (not after "--", where
  everything is the prompt)."""
  out = argv[:1]
  for i, a in enumerate(argv[1:]):
    if a == "--":
      return out + argv[1 + i:]
    if a.startswith("--") and len(a) > 2:
      name, eq, val = a[2:].partition("=")
      a = "--" + name.replace("-", "_") + eq + val
    out.append(a)
  return out


def _show_note(message, category, filename, lineno, file=None, line=None) -> None:
  """warnings.showwarning while main runs: jaxvt's own warnings as one `jaxvt: note:` line
  each; others (only shown with --verbose) as Python shows them."""
  if issubclass(category, JaxvtWarning):
    print(f"jaxvt: note: {escape(message, 2000)}", file=sys.stderr)
  else:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def quiet(verbose: bool):
  """While main runs, only jaxvt's own lines reach stderr unless `verbose`: XLA's C++ logs
  (TF_CPP_MIN_LOG_LEVEL=3, read when JAX starts: errors such as a scheduler's byte-size
  complaint and warnings such as rematerialization's), JAX's Python warnings (a read-only cache
  directory warns three times a run) and JAX's log records. jaxvt's warnings show as
  `jaxvt: note:` lines, once each. Undone on the way out (tests call main in-process)."""
  old_env = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
  jax_log = logging.getLogger("jax")
  old_level = jax_log.level
  with warnings.catch_warnings():
    warnings.showwarning = _show_note
    if not verbose:
      os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"  # FATAL only
      warnings.simplefilter("ignore")
      jax_log.setLevel(logging.CRITICAL)
    warnings.simplefilter("default", JaxvtWarning)
    try:
      yield
    finally:
      if not verbose:
        jax_log.setLevel(old_level)
        if old_env is None:
          os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
        else:
          os.environ["TF_CPP_MIN_LOG_LEVEL"] = old_env


