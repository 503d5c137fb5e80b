"""Compile once: the persistent compilation cache, warm-up, and the CLI's timing report."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest

import jaxvt
from jaxvt import ffi, programs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_ext = pytest.mark.skipif(not ffi.available("cpu"), reason="the jaxvt extension is not built")


def test_cache_root_from_setting_and_environment(tmp_path):
  env = {"HOME": "/home/u"}
  assert programs.default_cache_root(env).endswith(os.path.join(".cache", "jaxvt"))
  assert programs.default_cache_root({"XDG_CACHE_HOME": "/x"}) == "/x/jaxvt"
  assert programs.cache_root(None, {"XDG_CACHE_HOME": "/x"}) == "/x/jaxvt"
  for off in ("0", "off", "False"):
    assert programs.cache_root(None, {"JAXVT_COMPILE_CACHE": off}) is None
  assert programs.cache_root(None, {"JAXVT_COMPILE_CACHE": str(tmp_path)}) == str(tmp_path)
  assert programs.cache_root(False, {"JAXVT_COMPILE_CACHE": str(tmp_path)}) is None
  assert programs.cache_root(True, {"XDG_CACHE_HOME": "/x", "JAXVT_COMPILE_CACHE": "0"}) == \
      "/x/jaxvt"
  assert programs.cache_root("/y", {}) == "/y"


@needs_ext
def test_extension_identity_is_the_builds_hash():
  import hashlib
  with open(ffi.extension().__file__, "rb") as f:
    assert programs.extension_identity() == hashlib.sha256(f.read()).hexdigest()[:16]


def _cli(*args, env=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
  return subprocess.run([sys.executable, "-m", "jaxvt.run", *args], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=600)


def _programs(stderr: str) -> tuple[int, int]:
  m = re.search(r"compile .* \((\d+) programs compiled, (\d+) loaded from the compilation cache",
                stderr)
  assert m, stderr
  return int(m.group(1)), int(m.group(2))


@needs_ext
def test_second_run_loads_its_programs_from_the_cache(tmp_path):
  """Two identical CLI runs: the first compiles and fills the cache (under a directory keyed
  by the extension's build), the second compiles nothing; the cache off compiles again."""
  env = {"JAXVT_COMPILE_CACHE": str(tmp_path)}
  args = ("--prompt", "The capital of France is", "--max-tokens", "6")
  first = _cli(*args, env=env)
  assert first.returncode == 0, first.stderr
  compiled, cached = _programs(first.stderr)
  assert compiled >= 2 and cached == 0
  keyed = tmp_path / "xla" / programs.extension_identity()
  assert any(n.startswith("jit_prefill_fn-") for n in os.listdir(keyed))
  exported = tmp_path / "exported" / programs.extension_identity()  # jaxvt.exports
  assert len([n for n in os.listdir(exported) if n.endswith(".jaxexp")]) >= 2
  second = _cli(*args, env=env)
  assert second.returncode == 0, second.stderr
  assert _programs(second.stderr) == (0, compiled)
  assert second.stdout == first.stdout
  off = _cli(*args, "--nocompile_cache", env=env)
  assert off.returncode == 0 and _programs(off.stderr) == (compiled, 0), off.stderr


@needs_ext
def test_cli_reports_compile_apart_from_steady_rates(tmp_path):
  """The timing lines: load (where placing spent it), compile (with its warm-up, the first
  token's part while the weights loaded), then prefill and decode rates that hold no compile;
  and a log (stderr not a terminal) gets no progress-bar redraws."""
  p = _cli("--prompt", "The capital of France is", "--max-tokens", "8", "--nochat",
           env={"JAXVT_COMPILE_CACHE": str(tmp_path)})
  assert p.returncode == 0, p.stderr
  lines = p.stderr.splitlines()
  tail = [l.split()[0] for l in lines[-4:]]
  assert tail == ["load", "compile", "prefill", "decode"], p.stderr
  # where placing spent its time; the first token's programs compiled while the weights loaded
  assert re.fullmatch(r"load +\d+\.\d\d s \(placing \d+\.\d\d s; thread-seconds: read "
                      r"\d+\.\d\d GiB \d+\.\d\d s, upload \d+\.\d\d s, host tier 0\.00 GiB "
                      r"0\.00 s\)", lines[-4])
  assert re.search(r"; \d+\.\d\d s of it while the weights loaded(; the model's programs: 0 "
                   r"from the export store, [2-9] traced and stored)?\)$", lines[-3]), lines[-3]
  assert re.fullmatch(r"prefill +\d+\.\d{3} s for \d+ tokens: \d+\.\d tok/s", lines[-2])
  assert re.fullmatch(r"decode +\d+\.\d{3} s for 7 tokens: \d+\.\d tok/s \(8 generated, stop: "
                      r"max_tokens(; the device ran 8 steps: \d+\.\d steps/s)?\)", lines[-1])
  assert "\r" not in p.stderr and "loading weights" not in p.stderr


def test_budgets_print_as_given():
  p = _cli("--plan", "--device-gb", "0.85", "--offload-gb", "auto", "--max-context", "2048")
  assert p.returncode == 0, p.stderr
  assert "on this 0.85 GiB device" in p.stdout and "(--device-gb 0.85)" in p.stdout, p.stdout
  p = _cli("--plan", "--device-gb", "16", "--offload-gb", "0.25", "--model", "qwen3.6-35b-a3b")
  assert "offload plan: budget 0.25 GiB" in p.stdout, p.stdout


@needs_ext
def test_warm_up_leaves_nothing_to_compile_in_generate():
  """After warm_up for a prompt length and token count, generate compiles nothing (XLA's
  compile events, persistent-cache loads included), also where decoding crosses a KV-cache
  bucket; a new prompt bucket is compiled by generate's own warm-up and counted in
  compile_seconds, not in the rates; warm_up_buckets leaves no bucket to compile."""
  from benchmarks.arms import no_stops
  from jaxvt.sampling import SamplingParams
  counter = programs.compile_counter()
  with no_stops(jaxvt.load(max_context=300)) as eng:
    assert {kv for kv, _, _ in eng.decode_calls(240, 30)} == {256, 304}  # crosses 256; 300 rounds up
    for sp, n, n_tok in ((SamplingParams(), 240, 30),
                         (SamplingParams(temperature=0.7, top_k=20), 12, 4)):
      assert eng.warm_up(n, n_tok, sp) > 0
      before = counter.snapshot()
      g = eng.generate([1] * n, max_tokens=n_tok, sampling=sp)
      assert counter.snapshot()[0] == before[0]
      assert g.stats.compile_seconds == 0 and len(g.tokens) == n_tok
    assert eng.warm_up(240, 30) == 0.0  # nothing new
    before = counter.snapshot()
    g = eng.generate([1] * 40, max_tokens=4)  # a new prefill bucket
    assert g.stats.compile_seconds > 0 and counter.snapshot()[0] > before[0]
    assert eng.warm_up_buckets(max_tokens=4, background=False) > 0
    before = counter.snapshot()
    for n in (3, 17, 70):
      assert eng.generate([1] * n, max_tokens=4).stats.compile_seconds == 0
    assert eng.warm_up(250, 4) == eng.warm_up(300, 4) == 0.0  # the larger buckets too
    assert counter.snapshot()[0] == before[0]


@needs_ext
def test_first_token_before_decode_compiles():
  """generate compiles only prefill's programs before the first token; each decode program
  compiles when first needed (crossing a KV-cache bucket compiles the next one then), is
  counted in compile_seconds, and a second generate of the same shape compiles nothing."""
  from benchmarks.arms import no_stops
  counter = programs.compile_counter()
  with no_stops(jaxvt.load(max_context=300)) as eng:
    seen = []
    programs_of = lambda kind: sorted(k for k in eng.warmed if k[0] == kind)
    g = eng.generate([1] * 240, max_tokens=30, on_text=lambda _: seen.append(
        (programs_of("prefill"), programs_of("decode"))))
    assert seen and seen[0][0] and seen[0][1] == []  # prefill's, nothing of decode, at token 1
    want = {kv for kv, _, _ in eng.decode_calls(240, 30)}
    assert want == {256, 304} and {k[1] for k in programs_of("decode")} == want  # once needed
    assert [k[1] for k in seen[-1][1]] == [256, 304]  # the second when decoding crossed 256
    assert g.stats.compile_seconds > 0 and len(g.tokens) == 30
    before = counter.snapshot()
    again = eng.generate([1] * 240, max_tokens=30)
    assert again.stats.compile_seconds == 0 and counter.snapshot()[0] == before[0]
    assert again.tokens == g.tokens


@needs_ext
def test_generate_sends_the_next_decode_call_before_reading_tokens(monkeypatch):
  """The device never waits on the host between decode calls: generate dispatches the next
  call (its token and cache as the previous call returned them, on the device) before it reads
  the previous call's tokens; the tokens are those of the one-call-at-a-time order (the same
  greedy tokens as decode chunks of one step each, where every call is read before the next)."""
  from jaxvt import engine
  from benchmarks.arms import no_stops
  events = []
  real_fn, real_np = engine.runtime.decode_loop_fn, engine.runtime.np

  class Fn:
    def __call__(self, *a, **k):
      events.append(("call", k["steps"]))
      return real_fn(*a, **k)

    def compile(self, *a, **k):
      return real_fn.compile(*a, **k)

  class Np:
    def __getattr__(self, name):
      return getattr(real_np, name)

    def asarray(self, a, *args, **kw):
      if isinstance(a, jax.Array):  # a read back from the device (not a list made into one)
        events.append(("read", a.shape[0]))
      return real_np.asarray(a, *args, **kw)

  with no_stops(jaxvt.load(max_context=300)) as eng:
    eng.decode_chunk = 1
    one = eng.generate([1, 2, 3], max_tokens=12).tokens
    eng.decode_chunk = 4
    monkeypatch.setattr(engine.runtime, "decode_loop_fn", Fn())
    monkeypatch.setattr(engine.runtime, "np", Np())
    g = eng.generate([1, 2, 3], max_tokens=12)
  assert g.tokens == one and len(one) == 12
  # 11 decode tokens in calls of 4 (decode_steps): each read comes after the next call is sent
  assert events == [("call", 4), ("call", 4), ("read", 4), ("call", 4), ("read", 4),
                    ("read", 4)], events
