"""The OpenAI request fields of python -m jaxvt.serve, through the openai client against a real
server process: frequency/presence penalties and logprobs against a float64 numpy reference of
the logits the same model gives in this process (jaxvt's Python API), streamed and not;
max_completion_tokens; the response's `model`; max_tokens past the context; the fields refused
by name and the ones accepted and ignored; and the schema against the client's own request
types."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from jaxvt.serve import schema
from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.scheduler import Request
from test_serve_fixtures import smol  # noqa: F401  (the in-process engine: the reference)
from test_serve_http import KEY, Server

GREEDY = {"temperature": 0}
COUNT = "1, 2, 3, 4,"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  # No prefix cache: every request is a cold prefill, as the reference is (a prefix hit's first
  # token attends to the cached K/V rows, whose rounding moves its logits).
  s = Server(tmp_path_factory.mktemp("api"), "--max_context=256", "--prefix-cache-gb=0",
             f"--api-key={KEY}")
  yield s
  assert s.stop() == 0, s.stderr()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


def reference(eng, ids, n, freq=0.0, pres=0.0):
  """Greedy decoding of `ids` in float64 numpy over the engine's logits, with OpenAI's penalties
  over the generated tokens: (tokens, the raw logits' log-softmax at each step, the smallest gap
  between the best two penalized logits: how far from a tie every choice was)."""
  logits, cache = eng.prefill(ids)
  counts = np.zeros(eng.cfg.vocab_size)
  eos = set(eng.tokenizer.stop_ids)
  toks, lps, gap = [], [], np.inf
  for i in range(n):
    raw = np.asarray(logits, np.float64)
    x = raw - freq * counts - pres * (counts > 0)
    best, second = np.sort(x)[-2:][::-1]
    gap = min(gap, best - second)
    lps.append(_log_softmax(raw))
    t = int(np.argmax(x))
    if t in eos:
      break
    toks.append(t)
    counts[t] += 1
    logits, cache = eng.decode_step(cache, t, len(ids) + i)
  return toks, lps, gap


def _chat_ids(eng, msgs):
  return eng.tokenizer.encode(eng.tokenizer.apply_chat_template(msgs))


def test_penalties_change_greedy_tokens_as_the_reference_says(client, smol):
  ids = smol.encode_prompt(COUNT)
  pen = {"presence_penalty": 2.0, "frequency_penalty": 1.5}
  plain, _, _ = reference(smol, ids, 12)
  want, _, gap = reference(smol, ids, 12, freq=1.5, pres=2.0)
  assert gap > 1e-3 and want != plain  # a prompt where the penalties decide, far from ties
  text = smol.tokenizer.decode(want)

  def ask(kw):
    return client.completions.create(model="m", prompt=COUNT, max_tokens=12, **GREEDY, **kw)

  # penalized and unpenalized requests decoding together: each row its own counts and penalties
  with ThreadPoolExecutor(3) as ex:
    got = list(ex.map(ask, [pen, {}, pen]))
  assert [r.choices[0].text for r in got] == [text, smol.tokenizer.decode(plain), text]
  streamed = client.completions.create(model="m", prompt=COUNT, max_tokens=12, stream=True,
                                       **GREEDY, **pen)
  assert "".join(ch.choices[0].text for ch in streamed) == text
  msgs = [{"role": "user", "content": "Count: 1, 2, 3"}]
  want, _, gap = reference(smol, _chat_ids(smol, msgs), 10, freq=0.0, pres=2.0)
  r = client.chat.completions.create(model="m", messages=msgs, max_tokens=10, **GREEDY,
                                     presence_penalty=2.0)
  assert gap > 1e-3 and r.choices[0].message.content == smol.tokenizer.decode(want)


def test_penalty_counts_follow_a_request_moved_to_another_slot(smol):
  """A short request ends first and the last slot's penalized request moves down into its slot
  (compaction): its generated-token counts move with it, and both penalized requests keep the
  reference's tokens."""
  ids = smol.encode_prompt(COUNT)
  want, _, gap = reference(smol, ids, 12, freq=1.5, pres=2.0)
  assert gap > 1e-3
  loop = EngineLoop(smol, max_batch=3, max_queue=4)
  try:
    pen = dict(frequency_penalty=1.5, presence_penalty=2.0)
    reqs = [Request(prompt=ids, max_tokens=2), Request(prompt=ids, max_tokens=12, **pen),
            Request(prompt=ids, max_tokens=12, **pen)]
    assert all(ev.wait(300) for ev in [loop.submit(r) for r in reqs])
  finally:
    assert loop.close()
  assert reqs[2].slot == 0  # it moved from slot 2 into the first request's slot
  assert reqs[1].tokens == want[:12] and reqs[2].tokens == want[:12]


def _check_entry(tok, ref_lp, tid, logprob, top):
  """One token's served log-probability and top alternatives against the reference."""
  assert abs(logprob - ref_lp[tid]) < 1e-3, (logprob, ref_lp[tid])
  kth = np.sort(ref_lp)[::-1][len(top) - 1] if top else np.inf
  for t_bytes, lp in top:
    ids = [i for i in np.flatnonzero(np.abs(ref_lp - lp) < 1e-3)
           if tok.token_bytes(int(i)) == t_bytes]
    assert ids and lp >= kth - 1e-3, (t_bytes, lp, kth)


def test_chat_logprobs_are_the_log_softmax_of_the_model_logits(client, smol):
  want, ref, _ = reference(smol, _chat_ids(smol, CHAT), 8)
  kw = dict(model="m", messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3, **GREEDY)
  r = client.chat.completions.create(**kw)
  content = r.choices[0].logprobs.content
  assert [bytes(c.bytes) for c in content] == [smol.tokenizer.token_bytes(t) for t in want]
  assert "".join(c.token for c in content) == r.choices[0].message.content
  for c, t, lp in zip(content, want, ref):
    assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
    _check_entry(smol.tokenizer, lp, t, c.logprob,
                 [(bytes(a.bytes), a.logprob) for a in c.top_logprobs])
  chunks = list(client.chat.completions.create(**kw, stream=True))
  streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
              for c in ch.choices[0].logprobs.content]
  assert [(c.token, c.logprob, c.bytes) for c in streamed] == \
      [(c.token, c.logprob, c.bytes) for c in content]
  plain = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, **GREEDY)
  assert plain.choices[0].logprobs is None
  no_top = client.chat.completions.create(**{**kw, "top_logprobs": 0})
  assert [c.top_logprobs for c in no_top.choices[0].logprobs.content] == [[]] * len(content)


def test_completion_logprobs_are_the_log_softmax_of_the_model_logits(client, smol):
  want, ref, _ = reference(smol, smol.encode_prompt(COUNT), 10)
  kw = dict(model="m", prompt=COUNT, max_tokens=10, logprobs=2, **GREEDY)
  r = client.completions.create(**kw)
  lp = r.choices[0].logprobs
  tok = smol.tokenizer
  assert lp.tokens == [tok.token_bytes(t).decode() for t in want]
  assert lp.text_offset == [len(tok.decode(want[:i])) for i in range(len(want))]
  for i, (t, x) in enumerate(zip(want, ref)):
    assert len(lp.top_logprobs[i]) == 2
    _check_entry(tok, x, t, lp.token_logprobs[i],
                 [(s.encode(), v) for s, v in lp.top_logprobs[i].items()])
  chunks = list(client.completions.create(**kw, stream=True))
  got = {k: [v for ch in chunks if ch.choices[0].logprobs
             for v in getattr(ch.choices[0].logprobs, k)]
         for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
  assert got == {k: getattr(lp, k) for k in got}


def test_max_completion_tokens_is_max_tokens(client):
  a = client.completions.create(model="m", prompt=COUNT, max_tokens=5, **GREEDY)
  b = client.completions.create(model="m", prompt=COUNT, extra_body={"max_completion_tokens": 5},
                                **GREEDY)
  assert a.choices[0].text == b.choices[0].text and b.usage.completion_tokens == 5
  r = client.chat.completions.create(model="m", messages=CHAT, max_completion_tokens=3, **GREEDY)
  assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
  with pytest.raises(openai.BadRequestError, match="max_completion_tokens.*max_tokens"):
    client.chat.completions.create(model="m", messages=CHAT, max_completion_tokens=3,
                                   max_tokens=4)


def test_the_loaded_model_answers_whatever_model_is_asked(client):
  loaded = client.models.list().data[0].id
  assert loaded != "gpt-4o"
  r = client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
  assert r.model == loaded and r.choices[0].message.content is not None
  chunks = list(client.completions.create(model="gpt-4o", prompt=COUNT, max_tokens=2,
                                          stream=True))
  assert chunks and {ch.model for ch in chunks} == {loaded}


def test_max_tokens_past_the_context_is_clamped_with_finish_reason_length(client, smol):
  prompt = list(range(1000, 1240))  # 240 of the context's 256 tokens: room for 16
  no_eos = {str(t): -100 for t in smol.tokenizer.stop_ids}
  for stream in (False, True):
    r = client.completions.create(model="m", prompt=prompt, max_tokens=100000, logit_bias=no_eos,
                                  stream=stream, stream_options={"include_usage": True}
                                  if stream else None, **GREEDY)
    if stream:
      chunks = list(r)
      reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
      usage = chunks[-1].usage
    else:
      reason, usage = r.choices[0].finish_reason, r.usage
    assert reason == "length" and usage.completion_tokens == 256 - 240, stream


@pytest.mark.parametrize("path,extra,says", [
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"n": 2}, "n"), ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ("chat", {"metadata": {"k": 5}}, "metadata"),
    ("chat", {"service_tier": "fastest"}, "service_tier"),
    ("chat", {"b_field": 1, "a_field": 2}, "unknown fields: a_field, b_field"),
    ("chat", {"functions": []}, "unknown fields: functions"),
    ("chat", {"x\n\x1b[2J": 1}, "unknown fields: x\\n\\x1b[2J"),  # escaped: one line
    ("completions", {"logprobs": 6}, "logprobs"), ("completions", {"echo": True}, "echo"),
    ("completions", {"best_of": 3}, "best_of"), ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"n": 3}, "n"), ("completions", {"stop": ["a"] * 5}, "stop"),
    ("completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
])
def test_fields_refused_by_name(server, path, extra, says):
  base = ({"messages": CHAT} if path == "chat" else {"prompt": COUNT})
  r = httpx.post(f"{server.url}/v1/{'chat/' if path == 'chat' else ''}completions",
                 json={"model": "m", **base, **extra}, timeout=60,
                 headers={"Authorization": f"Bearer {KEY}"})
  err = r.json()["error"]
  assert r.status_code == 400 and err["type"] == "invalid_request_error"
  assert says in err["message"] and "\n" not in err["message"], err["message"]
  param = says[len("unknown fields: "):].split(",")[0] if says.startswith("unknown") else says
  assert err["param"] == param, err


def test_fields_accepted_and_ignored(client):
  want = client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, **GREEDY)
  r = client.chat.completions.create(
      model="m", messages=CHAT, max_tokens=6, user="u1", metadata={"k": "v"}, store=False,
      service_tier="auto", parallel_tool_calls=False, response_format={"type": "text"},
      frequency_penalty=0.0, presence_penalty=0.0, tool_choice="none", seed=3, **GREEDY)
  assert r.choices[0].message.content == want.choices[0].message.content
  r = client.completions.create(model="m", prompt=COUNT, max_tokens=4, user="u1", echo=False,
                                best_of=1, **GREEDY)
  assert r.choices[0].text and r.choices[0].logprobs is None


def test_schema_declares_or_names_every_field_the_client_sends():
  """Every field of the openai client's request types is declared by the schema or named in
  NOT_DECLARED (refused as unknown): a new client field is a decision, not an accident."""
  for theirs, ours in ((chat_create_params.CompletionCreateParamsBase, schema.ChatRequest),
                       (completion_create_params.CompletionCreateParamsBase,
                        schema.CompletionRequest)):
    # max_completion_tokens is read as max_tokens (a before-validator), not a field of its own
    declared = {f.alias or name for name, f in ours.model_fields.items()}
    declared |= {"max_completion_tokens"}
    fields = set(theirs.__annotations__)
    assert fields - declared <= schema.NOT_DECLARED, fields - declared - schema.NOT_DECLARED
    assert not declared & schema.NOT_DECLARED
