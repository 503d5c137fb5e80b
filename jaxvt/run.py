"""Command line: python -m jaxvt.run [--model PATH] [--prompt TEXT] [--offload-gb N] ...

With no flags it answers a short chat prompt with the embedded default model. Generated text
streams to stdout; progress, the placement and timings go to stderr. Errors a user can cause are
one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from jaxvt.errors import JaxvtError

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", None, "GGUF file to run (default: the embedded SmolLM2-135M-Instruct "
                    "Q4_1).", flag_values=FLAGS)
flags.DEFINE_string("prompt", None, f"Prompt text (default: a chat prompt, {DEFAULT_PROMPT!r}).",
                    flag_values=FLAGS)
flags.DEFINE_boolean("chat", None, "Wrap the prompt in the model's chat template (default: on "
                     "for the default prompt, off for --prompt).", flag_values=FLAGS)
flags.DEFINE_integer("max_tokens", 128, "Most tokens to generate.", flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.", flag_values=FLAGS)
flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).",
                     flag_values=FLAGS)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Random seed for sampling.", flag_values=FLAGS)
flags.DEFINE_integer("max_context", 2048, "Context length to allocate (prompt + generation).",
                     flag_values=FLAGS)
flags.DEFINE_string("offload_gb", "0", "GiB of weights to keep in the pinned host tier, read in "
                    "place by the kernels; 'auto' picks the best safe budget. With --mesh, per "
                    "device (as vLLM's --cpu-offload-gb).", flag_values=FLAGS)
flags.DEFINE_multi_string("offload_pattern", [], "REGEX[=host|device]: put the weights whose "
                          "label ('blk.3.moe.w_up') or GGUF name ('blk.3.ffn_up_exps.weight') "
                          "matches in that tier (host when no kind is given); repeat the flag for "
                          "several patterns. Forced host bytes count against --offload-gb.",
                          flag_values=FLAGS)
flags.DEFINE_float("device_gb", None, "Behave as if the device (each device of --mesh) had this "
                   "many GiB.", flag_values=FLAGS)
flags.DEFINE_string("mesh", None, "Shard the model over local devices: 'tp=N' (attention heads, "
                    "FFN columns, experts), 'ep=N' (experts only), or 'tp=N,ep=M'.",
                    flag_values=FLAGS)
flags.DEFINE_string("coordinator", None, "Several hosts: HOST:PORT of process 0 "
                    "(jax.distributed.initialize); with --num-processes and --process-id.",
                    flag_values=FLAGS)
flags.DEFINE_integer("num_processes", 1, "Several hosts: how many processes (one per host).",
                     flag_values=FLAGS)
flags.DEFINE_integer("process_id", 0, "Several hosts: this process's index.", flag_values=FLAGS)
flags.DEFINE_boolean("force", False, "Run a budget the planner calls unsafe.", flag_values=FLAGS)
flags.DEFINE_boolean("plan", False, "Print the placement plan and memory breakdown; do not "
                     "generate.", flag_values=FLAGS)
flags.DEFINE_boolean("deterministic", None, "Compile with XLA's algorithm choices fixed, so every "
                     "run and every --offload-gb gives the same tokens (default: on; "
                     "JAXVT_DETERMINISTIC=0 turns it off).", flag_values=FLAGS)
flags.DEFINE_boolean("compile_cache", None, "Keep compiled programs in JAX's persistent cache "
                     "under $XDG_CACHE_HOME/jaxvt or ~/.cache/jaxvt (default: on; "
                     "JAXVT_COMPILE_CACHE=0 turns it off, =DIR moves it).", flag_values=FLAGS)


def _validate(F) -> None:
  if F.max_tokens < 1:
    raise JaxvtError(f"--max-tokens must be at least 1 (got {F.max_tokens})")
  if F.temperature < 0:
    raise JaxvtError(f"--temperature must be >= 0 (got {F.temperature})")
  if F.top_k < 0:
    raise JaxvtError(f"--top-k must be >= 0 (got {F.top_k})")
  if not 0.0 < F.top_p <= 1.0:
    raise JaxvtError(f"--top-p must be in (0, 1] (got {F.top_p})")
  if F.max_context < 1:
    raise JaxvtError(f"--max-context must be at least 1 (got {F.max_context})")
  if F.device_gb is not None and F.device_gb <= 0:
    raise JaxvtError(f"--device-gb must be positive (got {F.device_gb})")
  if F.mesh is not None:
    from jaxvt.parallel import mesh
    mesh.parse(F.mesh)
  if F.coordinator is None and (F.num_processes != 1 or F.process_id != 0):
    raise JaxvtError("--num-processes / --process-id need --coordinator HOST:PORT")


def parse_offload(value: str) -> float | str:
  if value.strip().lower() == "auto":
    return "auto"
  try:
    gb = float(value)
  except ValueError:
    raise JaxvtError(f"--offload-gb takes a number of GiB or 'auto' (got {value!r})") from None
  if gb < 0:
    raise JaxvtError(f"--offload-gb must be >= 0 (got {value})")
  return gb


class _Bar:
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

  def finish(self) -> None:
    """Ends the bar's line (once), so what follows starts on a line of its own."""
    if self.shown >= 0 and self.shown != -2:
      sys.stderr.write("\n")
      sys.stderr.flush()
    self.shown = -2


def timing_report(eng, out, before: tuple[int, int, float], after: tuple[int, int, float]) -> str:
  """The run's timings, as llama.cpp reports them: loading, compiling (Engine.warm_up) on a
  line of its own, then steady-state prefill and decode rates. `before`/`after`:
  jaxvt.programs.CompileCounter snapshots around generate."""
  s = out.stats
  compiled, cached = after[0] - before[0], after[1] - before[1]
  check = f" (+ {eng.check_seconds:.2f} s XLA memory check)" if eng.check_seconds else ""
  n_dec = max(s.generated_tokens - 1, 0)  # the first token comes from prefill
  steps = ""
  if s.decode_steps > n_dec and s.decode_seconds > 0:  # a chunk ran on past the stop
    steps = (f"; the device ran {s.decode_steps} steps: "
             f"{s.decode_steps / s.decode_seconds:.1f} steps/s")
  return "\n".join([
      f"load     {eng.load_seconds:8.2f} s{check}",
      f"compile  {s.compile_seconds:8.2f} s ({compiled - cached} programs compiled, {cached} "
      "loaded from the compilation cache)",
      f"prefill  {s.prefill_seconds:8.3f} s for {s.prompt_tokens} tokens: "
      f"{s.prefill_tok_s:.1f} tok/s",
      f"decode   {s.decode_seconds:8.3f} s for {n_dec} tokens: {s.decode_tok_s:.1f} tok/s "
      f"({s.generated_tokens} generated, stop: {out.stopped_by}{steps})"])


def normalize_argv(argv: list[str]) -> list[str]:
  """Accepts --max-tokens as well as absl's --max_tokens spelling."""
  out = argv[:1]
  for a in argv[1:]:
    if a.startswith("--") and len(a) > 2:
      name, eq, val = a[2:].partition("=")
      a = "--" + name.replace("-", "_") + eq + val
    out.append(a)
  return out


def main(argv: list[str]) -> int:
  try:
    FLAGS(normalize_argv(argv))
  except flags.Error as e:
    print(f"jaxvt: error: {e}", file=sys.stderr)
    return 2
  F = FLAGS
  bar = None
  try:
    _validate(F)
    offload = parse_offload(F.offload_gb)
    # jaxvt's modules are imported here, not at the top: a bad flag or path is reported before
    # JAX starts
    from jaxvt.gguf.default_model import default_model_path
    from jaxvt.model.presets import PRESETS

    path = F.model or default_model_path()
    if not (F.plan and path.lower() in PRESETS and not os.path.exists(path)):
      from jaxvt.gguf.reader import check_path
      check_path(path)  # before JAX starts: a bad path is reported at once
    if F.coordinator is not None and not F.plan:
      from jaxvt.parallel import mesh
      mesh.initialize_distributed(F.coordinator, F.num_processes, F.process_id)
    from jaxvt import engine as engine_mod
    from jaxvt.sampling import SamplingParams
    if F.plan:
      print(engine_mod.plan_report(path, offload_gb=offload, device_gb=F.device_gb,
                                   max_context=F.max_context, mesh=F.mesh,
                                   offload_pattern=tuple(F.offload_pattern)))
      return 0
    bar = _Bar(os.path.getsize(path)) if os.path.isfile(path) else None

    def show_plan(placed):
      print(placed.report(), file=sys.stderr)

    from jaxvt import programs
    counter = programs.compile_counter()
    deterministic = (F.deterministic if F.deterministic is not None else
                     programs.env_flag(os.environ, "JAXVT_DETERMINISTIC"))
    cache = F.compile_cache  # None: JAXVT_COMPILE_CACHE or the default directory
    if cache:  # on even where the environment says off; in its directory if it names one
      cache = programs.cache_root(None, os.environ) or True
    eng = engine_mod.load(path, max_context=F.max_context, offload_gb=offload,
                          device_gb=F.device_gb, force=F.force, progress=bar, on_plan=show_plan,
                          mesh=F.mesh, offload_pattern=tuple(F.offload_pattern),
                          deterministic=deterministic, compile_cache=cache)
    if bar:
      bar.finish()
    with eng:
      chat = F.chat if F.chat is not None else F.prompt is None
      prompt = F.prompt if F.prompt is not None else DEFAULT_PROMPT
      params = SamplingParams(F.temperature, F.top_k, F.top_p)

      def emit(text):
        sys.stdout.write(text)
        sys.stdout.flush()

      before = counter.snapshot()
      out = eng.generate(prompt, max_tokens=F.max_tokens, sampling=params, seed=F.seed,
                         chat=chat, on_text=emit)
      sys.stdout.write("\n")
      sys.stdout.flush()
      print(timing_report(eng, out, before, counter.snapshot()), file=sys.stderr)
  except JaxvtError as e:
    if bar:
      bar.finish()
    print(f"jaxvt: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
