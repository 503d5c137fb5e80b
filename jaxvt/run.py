"""Command line: python -m jaxvt.run [PROMPT] [--model PATH] [--offload-gb N] ...

With no flags it answers a short chat prompt with the embedded default model. Generated text
streams to stdout; progress, the placement and timings go to stderr. Errors a user can cause are
one line on stderr and exit status 2; Ctrl-C at any moment is one line and exit status 130.
--help and --version answer without starting JAX (jaxvt.usage). Only jaxvt's own lines reach
stderr: XLA's C++ logs, JAX's Python warnings and log records are silenced at this edge before
JAX starts, unless --verbose; an XLA out-of-memory error becomes jaxvt's one line
(jaxvt.errors.out_of_memory).
Everything printed that did not come from jaxvt itself (generated text, paths, anything from the
model file) goes through jaxvt.errors.escape: no control character or terminal escape sequence
reaches the terminal (generated text keeps its newlines and tabs).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from absl import flags

from jaxvt import cli, inputs, usage
from jaxvt.cli import Bar, normalize_argv, quiet
from jaxvt.errors import JaxvtError, escape, out_of_memory

if TYPE_CHECKING:  # the CLI imports JAX only once it runs
  from jaxvt.prefix import PrefixCache
  from jaxvt.sampling import Generation, SamplingParams

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."

FLAGS = flags.FlagValues()
cli.define_model_flags(FLAGS)
flags.DEFINE_string("prompt", None, "Prompt text; a PROMPT argument after the flags is the same "
                    f"(default: {DEFAULT_PROMPT!r}).", flag_values=FLAGS)
flags.DEFINE_boolean("chat", None, "Wrap the prompt in the model file's chat template as a user "
                     "message (default: on where the file has a template, for --prompt too, as "
                     "llama-cli does; --nochat sends the prompt as raw text to complete).",
                     flag_values=FLAGS)
flags.DEFINE_integer("max_tokens", 128, "Most tokens to generate.", flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.", flag_values=FLAGS)
flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0, or a k at or above "
                     "the vocabulary: all).",
                     flag_values=FLAGS)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Random seed for sampling.", flag_values=FLAGS)
flags.DEFINE_boolean("interactive", False, "A conversation: each line on stdin is a user turn "
                     "answered in the chat template, and each turn prefills only what is new "
                     "(an empty line or end of input ends it).", short_name="i",
                     flag_values=FLAGS)
flags.DEFINE_boolean("plan", False, "Print the placement plan and memory breakdown to stdout; "
                     "do not generate.", flag_values=FLAGS)
cli.define_info_flags(FLAGS)


def _validate(F, prompt: str | None) -> float | str:
  """Checks every flag (and `prompt`: --prompt or the PROMPT argument) before JAX starts, with
  the checks the Python API makes (jaxvt.inputs); returns --offload-gb parsed (GiB or
  "auto")."""
  inputs.max_tokens(F.max_tokens, cli=True)
  inputs.sampling(F.temperature, F.top_k, F.top_p, cli=True)
  inputs.seed(F.seed, cli=True)
  offload = cli.validate_model_flags(F)
  if F.interactive and F.coordinator is not None:
    raise JaxvtError("--interactive runs in one process; leave out --coordinator (or serve the "
                     "model over several processes: python -m jaxvt.serve)")
  if prompt is not None:
    inputs.text(prompt, "the prompt" if F.prompt is None else "--prompt")
  return offload


def _n(count: int, noun: str) -> str:
  """`count noun`, the noun plural unless count is 1."""
  return f"{count} {noun}{'' if count == 1 else 's'}"


def timing_report(eng, out, compiled: int, cached: int, store=None) -> str:
  """The run's timings, as llama.cpp reports them: loading (and where placing spent it),
  compiling (Engine.warm_up: in load while the weights were placed, and in generate) on a line
  of its own, then steady-state prefill and decode rates. `compiled`, `cached`: XLA's compiles
  in those two (jaxvt.programs.CompileCounter), `cached` of them loaded from the cache;
  `store`: the export store (jaxvt.exports), whose programs were not traced."""
  s = out.stats
  check = f" (+ {eng.check_seconds:.2f} s XLA memory check)" if eng.check_seconds else ""
  lt, gib = eng.load_times, lambda n: f"{n / 2**30:.2f} GiB"
  placing = "" if lt is None else (
      f" (placing {eng.place_seconds:.2f} s; thread-seconds: read {gib(lt.read_bytes)} "
      f"{lt.read:.2f} s, upload {lt.upload:.2f} s, host tier {gib(lt.host_bytes)} {lt.host:.2f} s)")
  during = (f"; {eng.warm_seconds:.2f} s of it while the weights loaded" if eng.warm_seconds and
            eng.place_seconds else "")
  if store is not None and (store.loaded or store.written):
    during += (f"; the model's programs: {store.loaded} from the export store, "
               f"{store.written} traced and stored")
  n_dec = max(s.generated_tokens - 1, 0)  # the first token comes from prefill
  steps = ""
  if s.decode_steps > n_dec and s.decode_seconds > 0:  # a chunk ran on past the stop
    steps = (f"; the device ran {_n(s.decode_steps, 'step')}: "
             f"{s.decode_steps / s.decode_seconds:.1f} steps/s")
  return "\n".join([
      f"load     {eng.load_seconds:8.2f} s{check}{placing}",
      f"compile  {s.compile_seconds + eng.warm_seconds:8.2f} s "
      f"({_n(compiled - cached, 'program')} compiled, {cached} loaded from the compilation "
      f"cache{during})",
      f"prefill  {s.prefill_seconds:8.3f} s for {_n(s.prompt_tokens, 'token')}: "
      f"{s.prefill_tok_s:.1f} tok/s",
      f"decode   {s.decode_seconds:8.3f} s for {_n(n_dec, 'token')}: {s.decode_tok_s:.1f} tok/s "
      f"({s.generated_tokens} generated, stop: {out.stopped_by}{steps})"])


class _Interrupts:
  """Ctrl-C, handled in one place. While main runs, SIGINT does not raise KeyboardInterrupt
  (which JAX's start-up and callbacks can swallow: "Exception ignored in ... KeyboardInterrupt",
  and the run went on); it stops the run:

    1. the handler, in the main thread between two bytecodes, closes the engine (waits for the
       step in flight, frees the host tier), ends a half-written line, prints one line on stderr
       and exits with status 130 (os._exit: nothing else runs after it);
    2. where the main thread is inside one long call that does not return to Python (an XLA
       compile, a prefill), a watchdog thread woken by the signal does the same after GRACE_S
       seconds without closing the engine: the process's exit frees its memory;
    3. a second Ctrl-C exits at once.

  Installed only in the main thread, and undone when main returns (tests call main in-process).
  """

  GRACE_S = 2.0
  MESSAGE = "jaxvt: interrupted (Ctrl-C); the run stopped\n"

  def __init__(self):
    self.engine = None  # closed on an interrupt
    self.bar = None  # a progress bar whose line must be ended first
    self.stdout_open = False  # generated text was written without its final newline
    self._count = 0
    self._exiting = threading.Lock()
    self._installed = False

  def __enter__(self) -> "_Interrupts":
    if threading.current_thread() is not threading.main_thread():
      return self
    self._read, self._write = os.pipe()
    os.set_blocking(self._write, False)
    self._old_handler = signal.signal(signal.SIGINT, self._on_signal)
    self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
    self._watchdog = threading.Thread(target=self._watch, name="jaxvt-interrupt", daemon=True)
    self._watchdog.start()
    self._installed = True
    return self

  def __exit__(self, *exc) -> None:
    if not self._installed:
      return
    signal.set_wakeup_fd(self._old_fd)
    signal.signal(signal.SIGINT, self._old_handler)
    os.close(self._write)  # the watchdog reads end-of-file and returns
    self._watchdog.join(timeout=1.0)
    os.close(self._read)
    self._installed = False

  def _on_signal(self, signum, frame) -> None:
    self._count += 1
    if self._count == 1 and self.engine is not None:
      try:
        self.engine.close()
      except BaseException:  # exiting anyway; the process's exit frees what close did not
        pass
    self.exit(flush=True)

  def _watch(self) -> None:
    while True:
      try:
        got = os.read(self._read, 64)
      except OSError:
        return
      if not got:
        return
      if signal.SIGINT in got:
        threading.Event().wait(self.GRACE_S)  # the handler normally exits before this ends
        self.exit(flush=False)

  def exit(self, flush: bool) -> None:
    """Ends the output's open lines, prints the one line and exits with status 130."""
    if not self._exiting.acquire(blocking=False):  # the other path is already exiting
      return
    if flush:
      try:
        sys.stdout.flush()
      except BaseException:  # interrupted in the middle of a write: what is buffered is lost
        pass
    tail = b""
    if self.bar is not None and self.bar.shown >= 0:
      tail = b"\n"
    try:
      if self.stdout_open:
        os.write(1, b"\n")
      os.write(2, tail + self.MESSAGE.encode())
    finally:
      os._exit(130)


def open_preset(name: str):  # the imports here and below: the CLI imports JAX only once it runs
  """A weightless model of jaxvt.model.presets.PRESETS: its configuration and declarations, and
  each unit's bytes estimated for Q4_K_S-like formats (what `--plan --model NAME` plans)."""
  from jaxvt.loader import Model
  from jaxvt.model.declare import UnitBytes, declare
  from jaxvt.model.presets import PRESETS
  from jaxvt.offload.plan import Q4_K_S_LIKE, estimate_bytes
  cfg = PRESETS[name][1]()
  decls = declare(cfg)
  units = [UnitBytes(n, l, b, -1) for (n, l), b in estimate_bytes(decls, Q4_K_S_LIKE).items()]
  return Model(name, cfg, decls, units)


def plan_report(path: str, *, offload_gb: float | str = 0.0, device_gb: float | None = None,
                max_context: int | None = None, mesh: str | None = None,
                offload_pattern: tuple[str, ...] = ()) -> str:
  """`--plan`: the plan for the file at `path` (or a PRESETS name, weightless) without placing
  any weights; with `mesh`, one device's plan (its shards, its budget)."""
  from jaxvt.engine import plan
  from jaxvt.loader import open_model
  from jaxvt.model.presets import PRESETS
  from jaxvt.parallel import mesh as mesh_mod
  weightless = path.lower() in PRESETS and not os.path.exists(path)
  m = open_preset(path.lower()) if weightless else open_model(path)
  placed = plan(m, offload_gb=offload_gb, device_gb=device_gb, force=True,
                max_context=inputs.context_for(max_context, m.cfg.context_length), kernels=True, offload_pattern=offload_pattern,
                mesh=mesh_mod.parse(mesh))
  head = (f"{PRESETS[m.path][0]} (weightless; {m.cfg.n_layers} layers)" if weightless else
          f"{path} ({m.cfg.arch}, {m.cfg.n_layers} layers)")
  return f"model: {head}\n" + placed.plan_text(mesh)


def main(argv: list[str]) -> int:
  with _Interrupts() as interrupts:
    try:
      return _main(argv, interrupts)
    except KeyboardInterrupt:  # only where no handler could be installed (not the main thread)
      print(_Interrupts.MESSAGE, end="", file=sys.stderr)
      return 130


def _print_escaped(text: str, file=None) -> None:
  """Prints text that holds paths or file contents, line by line through escape."""
  print("\n".join(escape(line, None) for line in text.split("\n")), file=file)


def _preflight(path: str, prompt: str, chat: bool | None, plan: bool):
  """Before JAX starts: the file's header and config are checked, then (unless only a `plan` is
  asked for) its tokenizer is built, and with `chat` (None: where the file has a chat template)
  the prompt is rendered through the file's chat template (in a limited child process:
  jaxvt.gguf.chat_template); returns the prompt to encode, the tokenizer (None for a plan),
  which jaxvt.load then takes instead of reading the vocabulary again, and the bytes of the
  file's tensors (the progress bar's total). So a bad file or template is one line within a
  second or two, not after the weights have loaded."""
  from jaxvt.gguf.reader import open_gguf
  from jaxvt.gguf.tokenizer import Tokenizer
  from jaxvt.model.config import from_gguf_metadata
  gf = open_gguf(path)
  from_gguf_metadata(gf.metadata)
  nbytes = sum(t.n_bytes for t in gf.tensors.values())
  if plan:
    return prompt, None, nbytes
  tok = Tokenizer.from_gguf_metadata(gf.metadata, source=path, identity=gf.identity)
  if chat if chat is not None else tok.chat_template is not None:
    prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
  return prompt, tok, nbytes


def _parse(argv: list[str]) -> tuple[int | None, str | None]:
  """Parses argv into FLAGS: (None, the PROMPT argument or None) to run, or (exit status, None)
  where the CLI has answered already (--help, --version, a flag it does not know)."""
  try:
    FLAGS.unparse_flags()  # main may run more than once in a process (tests): start from defaults
    rest = FLAGS(normalize_argv(argv))[1:]
  except flags.Error as e:
    if any(a in usage.HELP_FLAGS for a in argv[1:]):
      sys.stdout.write(usage.help_text(FLAGS, "--helpfull" in argv[1:]))
      return 0, None
    if isinstance(e, flags.UnrecognizedFlagError):
      print(f"jaxvt: error: {usage.unknown_flag(e, FLAGS)}", file=sys.stderr)
    else:
      print(f"jaxvt: error: {escape(e, 2000)}; see --help", file=sys.stderr)
    return 2, None
  if FLAGS.help or FLAGS.helpfull:
    sys.stdout.write(usage.help_text(FLAGS, FLAGS.helpfull))
    return 0, None
  if FLAGS.version:
    sys.stdout.write(usage.version_text())
    return 0, None
  if len(rest) > 1:
    print(f"jaxvt: error: one PROMPT argument is taken, got {len(rest)} "
          f"({escape(' '.join(rest), 80)}); quote the prompt: python -m jaxvt.run "
          "\"your question\"", file=sys.stderr)
    return 2, None
  if rest and FLAGS.prompt is not None:
    print("jaxvt: error: the prompt is given twice (--prompt and a PROMPT argument); give "
          "one", file=sys.stderr)
    return 2, None
  return None, rest[0] if rest else FLAGS.prompt


def _main(argv: list[str], interrupts: _Interrupts) -> int:
  status, prompt = _parse(argv)
  if status is not None:
    return status
  with quiet(FLAGS.verbose):
    return _run(FLAGS, prompt, interrupts)


def _run(F, prompt: str | None, interrupts: _Interrupts) -> int:
  bar = None
  try:
    offload = _validate(F, prompt)
    # jaxvt's modules are imported here, not at the top: a bad flag, path or file is reported
    # before JAX starts
    from jaxvt.gguf.default_model import default_model_path
    from jaxvt.model.presets import PRESETS

    path = F.model if F.model is not None else default_model_path()
    first = [prompt] if prompt is not None else []  # --interactive's first turn, if given
    prompt = prompt if prompt is not None else DEFAULT_PROMPT
    tokenizer, nbytes = None, 0
    if not (F.plan and path.lower() in PRESETS and not os.path.exists(path)):
      prompt, tokenizer, nbytes = _preflight(path, prompt, False if F.interactive else F.chat,
                                                F.plan)
    if not F.plan:  # several processes: join them (jaxvt.parallel.processes)
      status = cli.join_processes(F, "jaxvt.run", path, dict(
          prompt=prompt, max_tokens=F.max_tokens, seed=F.seed,
          sampling=[F.temperature, F.top_k, F.top_p]))
      if status is not None:  # this process guarded the one that ran
        return status
    from jaxvt import engine as engine_mod
    from jaxvt.sampling import SamplingParams
    if F.plan:
      text = plan_report(path, offload_gb=offload, device_gb=F.device_gb,
                         max_context=cli.max_context(F), mesh=F.mesh,
                         offload_pattern=tuple(F.offload_pattern))
      _print_escaped(text)
      unsafe = [l for l in text.splitlines() if l.startswith("UNSAFE:")]
      if unsafe and not F.force:
        raise JaxvtError(f"the plan above is unsafe ({unsafe[0][len('UNSAFE: '):]}); use a safe "
                         "budget, or pass --force to accept it")
      return 0
    bar = interrupts.bar = Bar(nbytes) if nbytes else None

    def show_plan(placed):
      _print_escaped(placed.report(), file=sys.stderr)
      if F.coordinator is not None:
        from jaxvt.parallel import processes
        print(processes.describe(placed.devices), file=sys.stderr)

    from jaxvt import programs
    counter = programs.compile_counter()
    params = SamplingParams(F.temperature, F.top_k, F.top_p)

    marks = []  # CompileCounter snapshots around the compiles of the first token and generate

    def first_token_programs(early):
      """While the weights load: the programs of the first token (prefill's and its sampling);
      decode's compile after it, when generate first needs them."""
      marks.append(counter.snapshot())
      early.warm_up(len(early.encode_prompt(prompt)), 1, params)
      marks.append(counter.snapshot())

    eng = engine_mod.load(path, progress=bar, on_plan=show_plan, tokenizer=tokenizer,
                          while_loading=None if F.interactive else first_token_programs,
                          **cli.load_options(F))
    interrupts.engine = eng
    if bar:
      bar.finish(done=True)
    with eng:

      def emit(text):
        sys.stdout.write(escape(text, None, keep="\n\t"))
        sys.stdout.flush()
        interrupts.stdout_open = not text.endswith("\n")

      if F.interactive:
        return _converse(eng, F, params, first, emit, interrupts)
      marks.append(counter.snapshot())
      out = eng.generate(prompt, max_tokens=F.max_tokens, sampling=params, seed=F.seed,
                         on_text=emit)  # the chat template was applied by _preflight
      sys.stdout.write("\n")
      sys.stdout.flush()
      interrupts.stdout_open = False
      marks.append(counter.snapshot())
      spans = list(zip(marks[::2], marks[1::2]))
      print(timing_report(eng, out, sum(b[0] - a[0] for a, b in spans),
                          sum(b[1] - a[1] for a, b in spans), programs.export_store()),
            file=sys.stderr)
  except Exception as e:  # pylint: disable=broad-except  (re-raised unless it is the user's)
    error = e if isinstance(e, JaxvtError) else out_of_memory(e)
    if error is None and F.coordinator is not None:  # a collective failed: another process
      from jaxvt.parallel import processes  # died (one line, exit status 1)
      processes.peer_failure(e)
    if error is None:
      raise
    if bar:
      bar.finish()
    if interrupts.stdout_open:
      sys.stdout.write("\n")
      sys.stdout.flush()
    print(f"jaxvt: error: {error}", file=sys.stderr)
    return 2
  return 0


PREFIX_SEQUENCES = 4  # the prefix cache's budget, in whole sequences' caches


def turns(engine, lines: Iterable[str], *, max_tokens: int, sampling: SamplingParams,
          seed: int = 0, on_text: Callable[[str], None] | None = None,
          prefix: PrefixCache | None = None) -> Iterator[Generation]:
  """--interactive's conversation, as llama-cli's conversation mode: the answer to each line of
  `lines` (a user turn each, until an empty one). The whole conversation is rendered through the
  file's chat template (in its limited child process) and generated from; a prefix cache
  (`prefix`, default PREFIX_SEQUENCES sequences' worth) keeps what the earlier prompts computed,
  so a turn prefills only the previous answer and the new line, and its logits are a full
  prefill's to rounding (an answer's own rows are not kept: decode runs a few steps past its end,
  and rows a decode computed differ from a prefill's by rounding)."""
  from jaxvt.prefix import PrefixCache, sequence_bytes
  if prefix is None:
    prefix = PrefixCache(engine, PREFIX_SEQUENCES * sequence_bytes(engine))
  tok = engine.tokenizer
  if tok.chat_template is None:
    raise JaxvtError(f"{engine.path} has no chat template, which --interactive needs; use "
                     "--prompt for a single completion")
  messages: list[dict] = []
  for n, line in enumerate(lines):
    line = line.rstrip("\n")
    if not line.strip():
      return
    messages.append({"role": "user", "content": line})
    ids = tok.encode(tok.apply_chat_template(messages))
    room = engine.max_context - len(ids)
    if room < 1:
      raise JaxvtError(f"the conversation has {len(ids)} tokens, more than --max-context "
                       f"{engine.max_context}; start again with a larger --max-context")
    out = engine.generate(ids, max_tokens=min(max_tokens, room), sampling=sampling,
                          seed=seed + n, on_text=on_text, prefix=prefix)
    messages.append({"role": "assistant", "content": out.text})
    yield out


def _converse(eng, F, params, first: list[str], emit, interrupts: _Interrupts) -> int:
  """--interactive: turns from `first` then stdin (a "> " prompt on stderr where stdin is a
  terminal), answers on stdout, a line of figures per turn on stderr."""

  def lines():
    yield from first
    while True:
      if sys.stdin.isatty():
        sys.stderr.write("> ")
        sys.stderr.flush()
      line = sys.stdin.readline()
      if not line:
        return
      yield line

  print(f"jaxvt: a conversation with {escape(os.path.basename(eng.path), 200)}: type a turn and "
        "press Enter; an empty line or Ctrl-D ends it", file=sys.stderr)
  for out in turns(eng, lines(), max_tokens=F.max_tokens, sampling=params,
                               seed=F.seed, on_text=emit):
    sys.stdout.write("\n")
    sys.stdout.flush()
    interrupts.stdout_open = False
    st = out.stats
    print(f"jaxvt: {st.cached_tokens} of {st.prompt_tokens} prompt tokens reused, "
          f"{st.prompt_tokens - st.cached_tokens} prefilled in {st.prefill_seconds:.2f} s; "
          f"{st.generated_tokens} generated at {st.decode_tok_s:.1f} tok/s", file=sys.stderr)
  return 0


if __name__ == "__main__":
  status = main(sys.argv)
  # The run is over: a Ctrl-C while the interpreter shuts down (JAX's teardown) ends the process
  # with the run's status, not with an exception raised in the middle of that teardown.
  signal.signal(signal.SIGINT, lambda *_: os._exit(status))
  sys.exit(status)
