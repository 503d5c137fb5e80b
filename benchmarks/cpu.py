"""python -m benchmarks.cpu: jaxvt vs llama.cpp on the default model, same prompts, same run.

Decode: greedy tokens after a short prompt; prefill: a longer prompt. Each engine runs once to
warm up (jaxvt compiles; llama.cpp maps the file), then `repeats` timed runs; medians reported.
Long prompts (`--long`, token counts): jaxvt prefills random token ids of each length with
max_context the longest, warm (each length once to compile first; medians of `repeats` rounds),
and reports each rate against the first length's, so that a part of prefill growing faster than
the prompt shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import jaxvt
from benchmarks import report
from benchmarks.cli import parser_of, run

SHORT = "The capital of France is"
LONG = ("Write a detailed history of the city of Paris, from its founding as a Roman town on "
        "the Seine through the Middle Ages, the Revolution, the Haussmann renovation and the "
        "twentieth century, naming the people, buildings and events that shaped it. ") * 3


def parser() -> argparse.ArgumentParser:
  ap = parser_of("cpu", __doc__)
  ap.add_argument("--decode-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
  ap.add_argument("--long", default="512,1699,2048,8192",
                  help="long-prompt token counts, comma-separated ('' for none)")
  return ap


def bench_jaxvt(n_decode: int, repeats: int) -> dict:
  t0 = time.perf_counter()
  eng = jaxvt.load()
  load_s = time.perf_counter() - t0
  greedy = jaxvt.SamplingParams()
  long_ids = eng.tokenizer.encode(LONG)
  eng.generate(SHORT, max_tokens=n_decode, sampling=greedy)  # compile decode buckets
  eng.generate(long_ids, max_tokens=2, sampling=greedy)  # compile the long prefill bucket
  dec, pre = [], []
  for _ in range(repeats):
    g = eng.generate(SHORT, max_tokens=n_decode, sampling=greedy)
    dec.append(g.stats.decode_tok_s)
    t = time.perf_counter()
    logits, _ = eng.prefill(long_ids)
    logits.block_until_ready()
    pre.append(len(long_ids) / (time.perf_counter() - t))
  eng.close()
  return dict(load_s=load_s, decode=statistics.median(dec), prefill=statistics.median(pre),
              prompt_long=len(long_ids), kernels=eng.ex.kernels, tokens=g.tokens, path=eng.path)


def bench_long(lengths: list[int], repeats: int) -> list[dict]:
  """jaxvt's warm prefill rate for a prompt of each length (random token ids), one engine with
  max_context the longest length: the median of `repeats` runs after a compiling run, the
  lengths taken in turn in each round (so that a slower spell of a shared machine falls on
  every length alike)."""
  eng = jaxvt.load(max_context=max(lengths))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(10, eng.cfg.vocab_size - 10, n).tolist() for n in lengths]
  for ids in prompts:
    eng.prefill(ids)[0].block_until_ready()  # compile this length's programs
  times = [[] for _ in lengths]
  for _ in range(repeats):
    for ids, ts in zip(prompts, times):
      t = time.perf_counter()
      eng.prefill(ids)[0].block_until_ready()
      ts.append(time.perf_counter() - t)
  rows = []
  for n, ts in zip(lengths, times):
    s = statistics.median(ts)
    rows.append(dict(tokens=n, seconds=s, rate=n / s,
                     calls=" + ".join(f"{T}" for T, _ in eng.prefill_shapes(n))))
  eng.close()
  return rows


def bench_llamacpp(path: str, n_decode: int, repeats: int, threads: int) -> dict | None:
  """llama.cpp (llama-cpp-python) on the GGUF file at `path`, as bench_jaxvt times jaxvt; None
  where llama-cpp-python is not installed."""
  try:  # an optional reference (pip install llama-cpp-python==0.3.36)
    import llama_cpp
  except ImportError:
    return None
  llm = llama_cpp.Llama(path, n_ctx=1024, n_threads=threads,
                        n_threads_batch=threads, n_batch=512, verbose=False)
  short = llm.tokenize(SHORT.encode(), add_bos=False, special=True)
  long_ids = llm.tokenize(LONG.encode(), add_bos=False, special=True)

  def decode_run():
    llm.reset()
    llm.eval(short)
    toks = []
    t = time.perf_counter()
    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    for _ in range(n_decode - 1):
      toks.append(nxt)
      llm.eval([nxt])
      nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    toks.append(nxt)
    return (n_decode - 1) / (time.perf_counter() - t), toks

  def prefill_run():
    llm.reset()
    t = time.perf_counter()
    llm.eval(long_ids)
    return len(long_ids) / (time.perf_counter() - t)

  decode_run(), prefill_run()
  dec, pre = [], []
  for _ in range(repeats):
    d, toks = decode_run()
    dec.append(d)
    pre.append(prefill_run())
  llm.close()  # its threads and memory, before the long-prompt rows run in this process
  return dict(decode=statistics.median(dec), prefill=statistics.median(pre),
              version=llama_cpp.__version__, tokens=toks)


def main(args) -> str:
  n, reps = args.decode_tokens, args.repeats
  j = bench_jaxvt(n, reps)
  l = bench_llamacpp(j["path"], n, reps, args.threads)  # the file jaxvt.load() opened
  cmd = (f"python -m benchmarks.cpu --decode-tokens {n} --repeats {reps} --threads {args.threads}"
         f" --long '{args.long}'")
  lines = [f"## CPU: default model (SmolLM2-135M-Instruct Q4_1)\n",
           f"Command: `{cmd}`  ",
           f"Machine: {report.machine()}  ", f"Date: {report.stamp()}\n",
           f"Decode: {n} greedy tokens after {SHORT!r}; prefill: a {j['prompt_long']}-token "
           f"prompt. Medians of {reps} runs after a warm-up run.\n",
           "| engine | decode tok/s | prefill tok/s |", "|---|---|---|",
           f"| jaxvt ({'FFI kernels' if j['kernels'] else 'jnp reference'}) | "
           f"{j['decode']:.1f} | {j['prefill']:.1f} |"]
  if l:
    lines.append(f"| llama.cpp (llama-cpp-python {l['version']}, {args.threads} threads) | "
                 f"{l['decode']:.1f} | {l['prefill']:.1f} |")
    lines.append(f"\njaxvt / llama.cpp: decode {j['decode'] / l['decode']:.2f}x, prefill "
                 f"{j['prefill'] / l['prefill']:.2f}x. Greedy tokens identical: "
                 f"{j['tokens'] == l['tokens']}.")
  else:
    lines.append("\nllama.cpp arm not run: llama-cpp-python is not installed "
                 "(pip install llama-cpp-python==0.3.36).")
  lengths = [int(v) for v in args.long.split(",") if v.strip()]
  if lengths:
    rows = bench_long(lengths, reps)
    base = rows[0]
    lines += [f"\nLong prompts: jaxvt's warm prefill of random token ids, `jaxvt.load(max_context="
              f"{max(lengths)})`, medians of {reps} rounds (each length once a round) after a "
              f"compiling run; the rate against the {base['tokens']}-token prompt's.\n",
              "| prompt tokens | prefill calls (program lengths) | seconds | tok/s | vs "
              f"{base['tokens']} |", "|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['calls']} | {r['seconds']:.2f} | {r['rate']:.1f} | "
              f"{r['rate'] / base['rate']:.2f}x |" for r in rows]
  return report.publish("cpu", lines)


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  sys.exit(cli())
