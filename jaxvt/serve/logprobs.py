"""A request's token log-probabilities (Request.token_logprobs: the log-softmax of the model's raw
logits, computed on the device: jaxvt.sampling.token_logprobs) in OpenAI's two shapes: chat's
`logprobs.content` (one object per token with its bytes and top alternatives) and the legacy
completions' `logprobs` (parallel lists tokens / token_logprobs / top_logprobs / text_offset).

A token's text is its bytes as UTF-8; a token that holds part of a character shows the bytes it
holds as \\xNN escapes (its `bytes` are exact)."""

from __future__ import annotations

import codecs


def _text(b: bytes) -> str:
  return b.decode("utf-8", errors="backslashreplace")


def chat_content(tok, entries) -> list[dict]:
  """Chat's logprobs.content of `entries` [(token id, (logprob, [(id, logprob)...]))]."""
  out = []
  for tid, (lp, top) in entries:
    b = tok.token_bytes(tid)
    out.append({"token": _text(b), "logprob": lp, "bytes": list(b), "top_logprobs": [
        {"token": _text(tb), "logprob": x, "bytes": list(tb)}
        for tb, x in ((tok.token_bytes(i), x) for i, x in top)]})
  return out


class CompletionLogprobs:
  """The completions endpoint's logprobs of a stream of tokens, a chunk at a time: text_offset
  counts the characters of the completion before each token (a character split across tokens
  counts where it completes), from 0."""

  def __init__(self, tok):
    self.tok = tok
    self.chars = 0
    self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a split char

  def take(self, entries) -> dict:
    """The logprobs object of `entries` [(token id, (logprob, [(id, logprob)...]))], the tokens
    that follow those taken before."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, (lp, top) in entries:
      b = self.tok.token_bytes(tid)
      out["tokens"].append(_text(b))
      out["token_logprobs"].append(lp)
      out["top_logprobs"].append({_text(self.tok.token_bytes(i)): x for i, x in top})
      out["text_offset"].append(self.chars)
      self.chars += len(self.utf8.decode(b))
    return out
