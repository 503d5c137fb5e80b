"""Real server processes on free localhost ports, driven by the openai client and httpx: both
endpoints streamed and not, 8 concurrent clients each equal to its solo greedy answer, prompt
reuse (cached_tokens) on the default model and on a tiny hybrid qwen35moe file, every bad input,
the API key, a client that disconnects mid-stream, a full queue (429), and SIGTERM with a
request in flight."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from jaxvt.gguf.reader import open_gguf
from jaxvt.gguf.tokenizer import Tokenizer
from test_serve_fixtures import hybrid_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
GREEDY = {"temperature": 0}


class Server:
  """python -m jaxvt.serve on a free port of `host`; its stderr in a file."""

  def __init__(self, tmp, *args, host="127.0.0.1"):
    with socket.socket() as s:
      s.bind((host, 0))
      port = s.getsockname()[1]
    self.log = tmp / f"serve-{port}.log"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "jaxvt.serve", f"--host={host}", f"--port={port}", *args],
        cwd=ROOT, env=env, stderr=open(self.log, "w"))
    self.url = f"http://{host}:{port}"
    for _ in range(480):
      assert self.proc.poll() is None, self.stderr()
      try:
        if httpx.get(self.url + "/health").status_code == 200:
          return
      except httpx.TransportError:
        time.sleep(0.5)
    raise AssertionError("the server did not start:\n" + self.stderr())

  def stderr(self) -> str:
    return self.log.read_text()

  def stop(self, timeout=60) -> int:
    self.proc.send_signal(signal.SIGTERM)
    return self.proc.wait(timeout)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
  s = Server(tmp_path_factory.mktemp("smol"), "--max_context=256", f"--api-key={KEY}")
  yield s
  assert s.stop() == 0, s.stderr()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
  """A tiny qwen35moe file, its routed experts in the host tier and an expert cache (sized after
  the batch and the prefix cache); one slot and one place in the queue; on 127.0.0.2 (loopback, but not the
  default address) without a key."""
  tmp = tmp_path_factory.mktemp("hybrid")
  path = hybrid_file(tmp, context_length=1024)
  s = Server(tmp, f"--model={path}", "--max_context=1024", "--max-batch=1", "--max-queue=1",
             "--offload-gb=64", "--expert-cache-gb=0.01", host="127.0.0.2")
  gf = open_gguf(path)
  s.eos = Tokenizer.from_gguf_metadata(gf.metadata).stop_ids
  yield s
  if s.proc.poll() is None:
    s.stop()


def _client(s):
  return openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)


def test_both_endpoints_streamed_and_not(smol):
  c = _client(smol)
  r = c.completions.create(model="m", prompt="The capital of France is", max_tokens=12, **GREEDY)
  assert r.choices[0].text and r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 12
  streamed = c.completions.create(model="m", prompt="The capital of France is", max_tokens=12,
                                  stream=True, **GREEDY)
  assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text
  msgs = [{"role": "user", "content": "Hi"}]
  r = c.chat.completions.create(model="m", messages=msgs, max_tokens=12, **GREEDY)
  assert r.choices[0].message.content and r.usage.completion_tokens <= 12
  chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=12, stream=True,
                                          stream_options={"include_usage": True}, **GREEDY))
  text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
  assert text == r.choices[0].message.content
  assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
  assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
  assert c.models.list().data[0].id


def test_stop_strings_cut_streamed_and_not(smol):
  c = _client(smol)
  full = c.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=16, **GREEDY)
  text = full.choices[0].text
  stop = text[len(text) // 2:len(text) // 2 + 2]
  r = c.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=16, stop=[stop], **GREEDY)
  assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
  streamed = c.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=16, stop=stop,
                                  stream=True, **GREEDY)
  assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text


def test_eight_concurrent_clients_equal_their_solo_answers(smol):
  prompts = [f"Count from {i}:" for i in range(8)]
  c = _client(smol)

  def ask(p):
    return c.completions.create(model="m", prompt=p, max_tokens=8, **GREEDY).choices[0].text

  solo = [ask(p) for p in prompts]
  with ThreadPoolExecutor(8) as ex:
    together = list(ex.map(ask, prompts))
  assert together == solo


def test_seeded_sampling_repeats(smol):
  c = _client(smol)
  kw = dict(model="m", prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=7)
  assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text


def test_second_chat_turn_reuses_the_first(smol):
  c = _client(smol)
  msgs = [{"role": "user", "content": "Name a colour."}]
  r1 = c.chat.completions.create(model="m", messages=msgs, max_tokens=10, **GREEDY)
  msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
           {"role": "user", "content": "Another one?"}]
  hits = httpx.get(smol.url + "/health").json()["prefix_cache"]["hits"]
  r2 = c.chat.completions.create(model="m", messages=msgs, max_tokens=10, **GREEDY)
  assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
  assert httpx.get(smol.url + "/health").json()["prefix_cache"]["hits"] == hits + 1


def test_hybrid_second_turn_reuses_the_first(hybrid):
  c = openai.OpenAI(base_url=hybrid.url + "/v1", api_key="none", max_retries=0)
  first = list(range(200, 240))
  r1 = c.completions.create(model="m", prompt=first, max_tokens=6, **GREEDY)
  assert r1.usage.prompt_tokens_details.cached_tokens == 0
  assert r1.choices[0].text
  r2 = c.completions.create(model="m", prompt=first + list(range(260, 270)), max_tokens=6,
                            **GREEDY)
  # the first prompt's end is a stored recurrent-state snapshot
  assert r2.usage.prompt_tokens_details.cached_tokens == len(first)
  assert "no authentication" in hybrid.stderr()  # 127.0.0.2 is not the default address
  # the expert cache, sized after the batch and the prefix cache, served the decode's experts
  assert "expert cache:" in hybrid.stderr()
  xc = httpx.get(hybrid.url + "/health").json()["expert_cache"]
  assert xc["hits"] > 0 and xc["misses"] > 0


@pytest.mark.parametrize("content,status", [
    (b"{not json", 400), (b'{"prompt": "a", "bogus": 1}', 400),
    (b'{"prompt": "a", "temperature": NaN}', 400), (b'{"prompt": "a", "temperature": -1}', 400),
    (b'{"prompt": "a", "max_tokens": 0}', 400), (b'{"prompt": "a", "n": 2}', 400),
    (b'{"prompt": "' + b"a b " * 400 + b'"}', 400),
    (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413)])
def test_bad_input_gives_openai_error(smol, content, status):
  r = httpx.post(smol.url + "/v1/completions", content=content, timeout=60,
                 headers={"Authorization": f"Bearer {KEY}"})
  assert r.status_code == status and r.json()["error"]["message"]
  assert httpx.get(smol.url + "/health").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_api_key_is_required(smol, headers):
  for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
    r = httpx.request(method, smol.url + path, json={"prompt": "a"}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_client_disconnect_mid_stream_cancels_its_request(smol):
  with httpx.stream("POST", smol.url + "/v1/completions", timeout=60,
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={"prompt": "Tell me a long story", "max_tokens": 200, "stream": True,
                          "temperature": 0}) as r:
    lines = r.iter_lines()
    assert next(l for l in lines if l.startswith("data:"))
  deadline = time.time() + 60
  while "cancelled: the client disconnected" not in smol.stderr():
    assert time.time() < deadline, smol.stderr()
    time.sleep(0.2)
  assert _client(smol).completions.create(model="m", prompt="Hi", max_tokens=2).choices


def test_full_queue_gets_429_and_sigterm_drains_in_flight(hybrid):
  """One slot and one place in the queue: a third request at once gets 429 with Retry-After.
  SIGTERM while the first streams: it finishes, and the server exits 0."""
  body = {"prompt": list(range(200, 210)), "max_tokens": 1000, "temperature": 0, "stream": True,
          "logit_bias": {str(t): -100 for t in hybrid.eos}}  # no end-of-generation token
  first = httpx.stream("POST", hybrid.url + "/v1/completions", json=body, timeout=120)
  r = first.__enter__()
  lines = r.iter_lines()
  assert next(l for l in lines if l.startswith("data:"))  # decoding: it holds the slot
  waiting = threading.Thread(target=httpx.post, args=(hybrid.url + "/v1/completions",),
                             kwargs={"json": {**body, "stream": False, "max_tokens": 2},
                                     "timeout": 120})
  waiting.start()
  deadline = time.time() + 30
  while httpx.get(hybrid.url + "/health").json()["requests"]["queued"] < 1:
    assert time.time() < deadline
    time.sleep(0.05)
  refused = httpx.post(hybrid.url + "/v1/completions", json={**body, "stream": False})
  assert refused.status_code == 429 and refused.headers["retry-after"]
  hybrid.proc.send_signal(signal.SIGTERM)
  rest = [l for l in lines if l.startswith("data:")]
  first.__exit__(None, None, None)
  assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
  waiting.join(120)
  assert hybrid.proc.wait(120) == 0, hybrid.stderr()
