"""Text <-> token ids for GGUF byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`).

Built to give llama.cpp's token ids exactly (its `llama_tokenize(..., parse_special)`):

1. Special-token partition. Control (type 3), unknown (2) and user-defined (4) tokens are cut out
   of the text first, longest token text first, every occurrence, before any regex runs. With
   `parse_special=False` control and unknown tokens stay plain text; user-defined ones are still cut
   out (as llama.cpp and HF do).
2. Each remaining fragment goes through HF `tokenizers`: the pre-tokenizer is a sequence of
   "isolated" regex splits chosen by `tokenizer.ggml.pre` (llama.cpp applies its list of regexes the
   same way: each splits every piece into matches and the gaps between them), then the GPT-2
   byte-to-unicode mapping, then BPE over `tokenizer.ggml.merges` (lowest rank first, leftmost on
   ties, as in llama.cpp). llama3-style vocabularies look a whole piece up before merging
   (`ignore_merges`).

Token types follow llama.cpp's reading of the file, including its by-text rules: end-of-generation
tokens (`<|im_end|>`, `<|endoftext|>`, ..., FIM pad/repo/sep) are forced to control type and make
up `eog_ids`. Decoding maps normal tokens back through the byte table and copies control and
user-defined token text verbatim (control tokens only when `special=True`, like llama.cpp's
`token_to_piece(..., special)`); it never applies llama.cpp's `clean_up_tokenization_spaces` pass,
so streamed and whole decodes agree.

Known difference: HF `tokenizers` classifies code points with Unicode 16 tables, llama.cpp with its
own older tables (unicode-data.cpp). For the ~5,000 code points new in Unicode 16 (scripts such
as Garay, Todhri, Kirat Rai, some symbols) the letter / number / mark classes differ, so
pre-tokenization there may split differently. All other code points, and the whitespace set, agree.

`Tokenizer.from_gguf_metadata(md)` takes the decoded metadata dict of `jaxvt.gguf.reader` (values as
Python objects: `tokenizer.ggml.tokens` list[str], `merges` list[str], `token_type` list[int]).
"""

from __future__ import annotations

import codecs
import dataclasses
import re
from typing import Any, Iterable, Iterator, Mapping, Sequence

from jaxvt import inputs
from jaxvt.errors import JaxvtError, escape
from jaxvt.gguf.chat_template import render as render_template
from jaxvt.gguf.reader import read_metadata

# gguf.TokenType
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)

# GPT-2's regex plus HF's trailing `\s+`. llama.cpp spells it without the `|\s+`, but its
# hand-written matcher for that regex falls back to a whitespace run exactly as `\s+` does.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# The llama3 / qwen2 / qwen35 regexes as llama.cpp adapts them from the HF tokenizer.json files
# ((?i:'s|...) spelled out case by case).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
  """One llama.cpp pre-tokenizer family: regexes applied in order, BPE options, BOS default."""
  name: str
  regexes: tuple[str, ...]
  ignore_merges: bool = False
  add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    p.name: p for p in (
        PreTokenizer("default", (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
        PreTokenizer("gpt2", (_GPT2,)),
        PreTokenizer("smollm", (r"\p{N}", _GPT2)),  # starcoder-style: every digit alone
        PreTokenizer("llama3", (_LLAMA3,), ignore_merges=True, add_bos=True),
        PreTokenizer("llama3-merges", (_LLAMA3,)),  # same regex, plain BPE (dbrx, smaug)
        PreTokenizer("qwen2", (_QWEN2,)),
        PreTokenizer("qwen35", (_QWEN35,)),
    )
}

# tokenizer.ggml.pre value -> family, as llama.cpp's vocabulary loader groups them.
PRE_NAMES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "gigachat", "a.x-4.0",
                     "mellum", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), "smollm"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "llama3-merges"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"),
                    "qwen2"),
    "qwen35": "qwen35",
}

# llama.cpp's by-text special-token rules (llama-vocab.cpp, "auto-detect special tokens by text").
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["))
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss
_BPE_DEFAULT_SPECIAL = 11  # llama.cpp's BOS/EOS id for gpt2 vocabularies that name none

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character table."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _md_int(md: Mapping[str, Any], key: str) -> int | None:
  v = md.get(key)
  return v if isinstance(v, int) and not isinstance(v, bool) else None


def _md_bool(md: Mapping[str, Any], key: str, default: bool) -> bool:
  v = md.get(key)
  return default if v is None else bool(v)


def _bos_eos(md: Mapping[str, Any], n: int) -> tuple[int | None, int | None]:
  """The BOS and EOS ids of a vocabulary of `n` tokens: the file's, else llama.cpp's default."""
  default = _BPE_DEFAULT_SPECIAL if _BPE_DEFAULT_SPECIAL < n else None
  ids = [_md_int(md, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")]
  bos, eos = (v if v is not None and 0 <= v < n else default for v in ids)
  return bos, eos


def _chat_template(md: Mapping[str, Any]) -> str | None:
  template = md.get("tokenizer.chat_template")
  return template if isinstance(template, str) and template else None


def _render_chat(template: str | None, bos_token: str, eos_token: str,
                 messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                 kwargs: Mapping[str, Any], source: str) -> str:
  if template is None:
    raise JaxvtError(f"{escape(source)} has no chat template (tokenizer.chat_template); "
                     "pass a raw prompt instead of chat messages, or use a model file that "
                     "carries one")
  variables = dict(bos_token=bos_token, eos_token=eos_token)
  variables.update(kwargs)
  variables.update(messages=[dict(m) for m in messages],
                   add_generation_prompt=add_generation_prompt)
  return render_template(template, variables, source)


def read_tokenizer_metadata(path: str) -> dict[str, Any]:
  """The `tokenizer.*` and `general.*` metadata of a GGUF file, decoded as the reader's dict
  (jaxvt.gguf.reader.read_metadata: the key/value section only; tensor data is never touched)."""
  return read_metadata(path, ("tokenizer.", "general."))


def _vocab_metadata(md: Mapping[str, Any]) -> tuple[list, list | None, list, str]:
  """(tokens, token types or None, merges, pre-tokenizer name) from GGUF metadata, each of the
  type GGUF gives it; JaxvtError otherwise."""
  model = md.get("tokenizer.ggml.model")
  if model is None:
    raise JaxvtError("the GGUF file has no tokenizer (tokenizer.ggml.model missing); "
                     "use a GGUF converted with its tokenizer")
  if model != "gpt2":
    raise JaxvtError(f"tokenizer.ggml.model={escape(repr(model), 80)} is not supported (only "
                     "'gpt2' byte-level BPE); use a model with a BPE vocabulary")
  tokens = md.get("tokenizer.ggml.tokens")
  merges = md.get("tokenizer.ggml.merges")
  types = md.get("tokenizer.ggml.token_type")
  pre = md.get("tokenizer.ggml.pre")
  fix = "the file is corrupt; convert the model again"
  if not isinstance(tokens, list) or not isinstance(merges, list):
    raise JaxvtError("the GGUF tokenizer lacks tokenizer.ggml.tokens or tokenizer.ggml.merges; "
                     "convert the model again")
  if not all(isinstance(t, str) for t in tokens) or not all(isinstance(m, str) for m in merges):
    raise JaxvtError(f"tokenizer.ggml.tokens and .merges must be arrays of strings; {fix}")
  if types is not None and not (isinstance(types, list) and all(
      isinstance(t, int) and not isinstance(t, bool) for t in types)):
    raise JaxvtError(f"tokenizer.ggml.token_type must be an array of integers; {fix}")
  if pre is not None and not isinstance(pre, str):
    raise JaxvtError(f"tokenizer.ggml.pre must be a string; {fix}")
  key = f"{md.get('general.architecture')}.vocab_size"
  rows = md.get(key)  # the embedding's and the output head's rows (jaxvt.model.config)
  if isinstance(rows, int) and not isinstance(rows, bool) and rows != len(tokens):
    raise JaxvtError(f"the GGUF vocabulary has {len(tokens)} tokens but '{escape(key, 80)}' "
                     f"gives the model {rows} (the rows of its embedding and output head), so "
                     f"tokens would have no text or no row; {fix}")
  return tokens, types, merges, pre or "default"


def _check_vocab(tokens: Sequence[str], types: Sequence[int], pre: str) -> str:
  """The pre-tokenizer family of a vocabulary, after the checks a converted one passes."""
  n = len(tokens)
  if n == 0:
    raise JaxvtError("the GGUF file's vocabulary is empty; convert the model again")
  if len(types) != n:
    raise JaxvtError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens; "
                     "the file is corrupt, convert the model again")
  family = PRE_NAMES.get(pre or "default")
  if family is None:
    known = ", ".join(sorted(PRE_NAMES))
    raise JaxvtError(f"unsupported pre-tokenizer tokenizer.ggml.pre={escape(repr(pre), 80)} "
                     f"(known: {known}); use a model whose GGUF names one of these")
  if len(set(tokens)) != n:
    raise JaxvtError("the GGUF vocabulary holds duplicate token texts; convert the model again")
  return family


class Tokenizer:
  """A GGUF byte-level BPE tokenizer matching llama.cpp's ids; see the module docstring.

  Attributes: `bos_id`, `eos_id`, `eot_id`, `eom_id` (int or None), `eog_ids` (frozenset: every
  id that ends generation by llama.cpp's rule), `add_bos`, `add_eos`, `pre` (the file's
  `tokenizer.ggml.pre`), `chat_template` (str or None), `tokens` (token texts as stored),
  `token_types` (after llama.cpp's by-text overrides), `source` (the file, for messages),
  `identity` (GGUFFile.identity of the file it was built from, or None).
  """

  def __init__(self, tokens: Sequence[str], token_types: Sequence[int] | None,
               merges: Sequence[str], pre: str, md: Mapping[str, Any],
               source: str = "the model file", identity: tuple | None = None):
    from tokenizers import Regex, Tokenizer as _HFTokenizer, models, pre_tokenizers

    self.source = source
    self.identity = identity
    n = len(tokens)
    self.tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = list(token_types) if token_types is not None else [NORMAL] * n
    self.pre = pre
    self.pre_tokenizer = PRE_TOKENIZERS[_check_vocab(self.tokens, types, pre)]
    self._id: dict[str, int] = {t: i for i, t in enumerate(self.tokens)}

    def meta_id(key: str) -> int | None:
      v = _md_int(md, f"tokenizer.ggml.{key}")
      return v if v is not None and 0 <= v < n else None

    self.bos_id, self.eos_id = _bos_eos(md, n)
    self.add_bos = _md_bool(md, "tokenizer.ggml.add_bos_token", self.pre_tokenizer.add_bos)
    self.add_eos = _md_bool(md, "tokenizer.ggml.add_eos_token", False)
    self.chat_template: str | None = _chat_template(md)

    # llama.cpp's by-text detection: a detected token becomes control type.
    def detect(texts: Iterable[str]) -> int | None:
      for t in texts:
        i = self._id.get(t)
        if i is not None:
          if types[i] != CONTROL:
            types[i] = CONTROL
          return i
      return None

    self.eot_id = meta_id("eot_token_id")
    if self.eot_id is None:
      self.eot_id = detect(_EOT_TEXTS)
    self.eom_id = meta_id("eom_token_id")
    if self.eom_id is None:
      self.eom_id = detect(_EOM_TEXTS)
    fim_keys = {"pre": ("fim_pre_token_id", "prefix_token_id"),
                "suf": ("fim_suf_token_id", "suffix_token_id"),
                "mid": ("fim_mid_token_id", "middle_token_id"),
                "pad": ("fim_pad_token_id",), "rep": ("fim_rep_token_id",),
                "sep": ("fim_sep_token_id",)}
    fim: dict[str, int | None] = {}
    for name, keys in fim_keys.items():
      found = next((v for v in (meta_id(k) for k in keys) if v is not None), None)
      fim[name] = found if found is not None else detect(_FIM_TEXTS[name])
    eog = {fim[k] for k in ("pad", "rep", "sep") if fim[k] is not None}
    for i, t in enumerate(self.tokens):
      if t in _EOG_TEXTS:
        eog.add(i)
        types[i] = CONTROL
    for t in _ALWAYS_RENDERED:
      if t in self._id:
        types[self._id[t]] = USER_DEFINED
    eog.update(i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None)
    eog_texts = {self.tokens[i]: i for i in eog}
    if ("<|end|>" in eog_texts and ({"<|return|>", "<|call|>"} <= eog_texts.keys()
                                    or {"<|calls|>", "<|flush|>"} <= eog_texts.keys())):
      end = eog_texts["<|end|>"]  # harmony / solar-open: <|end|> closes a message, not the turn
      eog.discard(end)
      types[end] = USER_DEFINED
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
      eog.discard(eog_texts["</s>"])
      types[eog_texts["</s>"]] = NORMAL
    self.eog_ids: frozenset[int] = frozenset(eog)
    self.token_types: list[int] = types

    # Special-token partition order: longest text first (llama.cpp's cache_special_tokens).
    special = [i for i, ty in enumerate(types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)]
    special.sort(key=lambda i: -len(self.tokens[i].encode("utf-8")))
    self._special_all = [(i, self.tokens[i]) for i in special]
    self._special_user = [(i, self.tokens[i]) for i in special if types[i] == USER_DEFINED]

    pairs = []
    for m in merges:
      cut = m.find(" ", 1)  # the first space after the first character, as llama.cpp splits
      if cut < 0:
        continue
      a, b = m[:cut], m[cut + 1:]
      # HF refuses merges over unknown texts; llama.cpp would merge and then spell the result as
      # bytes. No converted vocabulary we know carries such merges.
      if a in self._id and b in self._id and a + b in self._id:
        pairs.append((a, b))
    bpe = models.BPE(vocab=dict(self._id), merges=pairs,
                     ignore_merges=self.pre_tokenizer.ignore_merges, fuse_unk=False,
                     byte_fallback=False)
    hf = _HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
         for r in self.pre_tokenizer.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    self._hf = hf
    self._pieces: list[bytes | None] = [None] * n

  # ---------------------------------------------------------------------------------------------
  @classmethod
  def from_gguf_metadata(cls, md: Mapping[str, Any], source: str = "the model file",
                         identity: tuple | None = None) -> "Tokenizer":
    """Builds the tokenizer from a decoded GGUF metadata dict; JaxvtError if it has none or if
    its values are not of the types GGUF gives them. `source` names the file in messages;
    `identity` is the file's GGUFFile.identity (jaxvt.load takes a tokenizer that carries the
    identity of the file it opens instead of building one)."""
    tokens, types, merges, pre = _vocab_metadata(md)
    return cls(tokens, types, merges, pre, md, source, identity)

  @staticmethod
  def check_metadata(md: Mapping[str, Any]) -> None:
    """Raises the JaxvtError from_gguf_metadata would raise for `md`, without building the
    tokenizer or keeping anything (jaxvt.engine.load checks a file early and builds last)."""
    tokens, types, _, pre = _vocab_metadata(md)
    texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    _check_vocab(texts, types if types is not None else [NORMAL] * len(tokens), pre)

  @classmethod
  def from_gguf(cls, path: str) -> "Tokenizer":
    """Reads the tokenizer metadata of `path` (a GGUF file) and builds its tokenizer."""
    return cls.from_gguf_metadata(read_tokenizer_metadata(path), source=path)

  # ---------------------------------------------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    return len(self.tokens)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The end-of-generation ids, sorted (eos, end-of-turn tokens, FIM pad/repo/sep)."""
    return tuple(sorted(self.eog_ids))

  def is_eog(self, token_id: int) -> bool:
    return token_id in self.eog_ids

  @property
  def bos_token(self) -> str:
    return self.tokens[self.bos_id] if self.bos_id is not None else ""

  @property
  def eos_token(self) -> str:
    return self.tokens[self.eos_id] if self.eos_id is not None else ""

  def token_id(self, text: str) -> int | None:
    """The id whose stored text is exactly `text`, or None."""
    return self._id.get(text)

  # ---------------------------------------------------------------------------------------------
  def _partition(self, text: str, parse_special: bool) -> list[str | int]:
    frags: list[str | int] = [text] if text else []
    for tid, s in (self._special_all if parse_special else self._special_user):
      if not any(isinstance(f, str) and s in f for f in frags):
        continue
      out: list[str | int] = []
      for f in frags:
        if isinstance(f, int) or s not in f:
          out.append(f)
          continue
        for k, part in enumerate(f.split(s)):
          if k:
            out.append(tid)
          if part:
            out.append(part)
      frags = out
    return frags

  def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
             add_eos: bool | None = None) -> list[int]:
    """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

    add_bos / add_eos: None follows the file (`tokenizer.ggml.add_bos_token` / `add_eos_token`).
    parse_special: recognise control tokens such as `<|im_start|>` written in the text.
    `text` must be valid Unicode (jaxvt.inputs.text: UTF-8 bytes are decoded, text holding
    undecodable bytes is refused).
    """
    text = inputs.text(text, "the text")
    ids: list[int] = []
    if self.add_bos if add_bos is None else add_bos:
      if self.bos_id is None:
        raise JaxvtError("this vocabulary has no BOS token; encode with add_bos=False")
      ids.append(self.bos_id)
    for frag in self._partition(text, parse_special):
      if isinstance(frag, int):
        ids.append(frag)
      else:
        ids.extend(self._hf.encode(frag, add_special_tokens=False).ids)
    if self.add_eos if add_eos is None else add_eos:
      if self.eos_id is None:
        raise JaxvtError("this vocabulary has no EOS token; encode with add_eos=False")
      ids.append(self.eos_id)
    return ids

  def token_bytes(self, token_id: int, special: bool = True) -> bytes:
    """The bytes one token stands for (llama.cpp's `token_to_piece`); control tokens render
    their text only when `special`."""
    token_id = int(token_id)
    if not 0 <= token_id < len(self.tokens):
      raise ValueError(f"token id {token_id} outside the vocabulary [0, {len(self.tokens)})")
    ty = self.token_types[token_id]
    if ty in (CONTROL, UNKNOWN) and not special:
      return b""
    piece = self._pieces[token_id]
    if piece is None:
      text = self.tokens[token_id]
      if ty in (CONTROL, UNKNOWN, USER_DEFINED):
        piece = text.encode("utf-8")
      elif ty == NORMAL:
        # A character outside the byte table (never in a converted vocabulary) is kept as UTF-8.
        piece = b"".join(bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode()
                         for c in text)
      elif ty == BYTE:
        m = _BYTE_TOKEN.fullmatch(text)
        piece = (bytes([int(m.group(1), 16)]) if m
                 else bytes(_UNICODE_TO_BYTE.get(c, 0) for c in text))
      else:  # unused / undefined tokens print nothing
        piece = b""
      self._pieces[token_id] = piece
    return piece

  def decode(self, ids: Iterable[int], special: bool = True) -> str:
    """Text of `ids` (invalid UTF-8 becomes U+FFFD). `special=False` hides control tokens."""
    return b"".join(self.token_bytes(i, special) for i in ids).decode("utf-8", errors="replace")

  def stream_decoder(self, special: bool = True) -> "StreamDecoder":
    return StreamDecoder(self, special)

  def decode_stream(self, ids: Iterable[int], special: bool = True) -> Iterator[str]:
    """Yields text pieces as tokens arrive; a multibyte character split across tokens is held back
    until complete. The pieces concatenate to `decode(ids)`."""
    dec = StreamDecoder(self, special)
    for i in ids:
      piece = dec.push(i)
      if piece:
        yield piece
    tail = dec.flush()
    if tail:
      yield tail

  # ---------------------------------------------------------------------------------------------
  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Renders `tokenizer.chat_template` (jinja2, sandboxed, HF conventions) for `messages`, in
    a process of its own with time, memory and output limits (jaxvt.gguf.chat_template).

    Variables: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, plus `kwargs`
    (e.g. `tools=`, `enable_thinking=`); helpers `raise_exception`, `strftime_now`, filter `tojson`.
    The result is text: encode it with parse_special=True and add_bos=None.
    """
    return _render_chat(self.chat_template, self.bos_token, self.eos_token, messages,
                        add_generation_prompt, kwargs, self.source)


class StreamDecoder:
  """Incremental detokenizer: `push(id)` returns the newly completed text (possibly ''), never a
  partial UTF-8 character; `flush()` returns what is left (incomplete bytes become U+FFFD)."""

  def __init__(self, tokenizer: Tokenizer, special: bool = True):
    self._tok = tokenizer
    self._special = special
    self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def push(self, token_id: int) -> str:
    return self._dec.decode(self._tok.token_bytes(token_id, self._special))

  def flush(self) -> str:
    return self._dec.decode(b"", final=True)
