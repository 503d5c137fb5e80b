"""What an operator relies on, against a real server process on loopback (a tiny hybrid qwen35moe
file, one slot, an expert cache, an API key): GET /metrics (parsed by prometheus-client's own
parser) counts what the clients saw, an access log line per request; and faults: a thousand
silent connections, a stream read slower than it is produced, requests cancelled while they
wait in the queue, a stream nobody reads (the send timeout, in-process)."""

import asyncio
import json
import os
import re
import selectors
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import StreamingResponse

from jaxvt.gguf.reader import open_gguf
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.serve.limits import SendTimeout
from test_serve_fixtures import hybrid_file
from test_serve_http import Server

KEY = "ops-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("ops")
  path = hybrid_file(tmp, context_length=1024)
  s = Server(tmp, f"--model={path}", "--max_context=1024", "--max-batch=1", "--max-queue=4",
             "--offload-gb=64", "--expert-cache-gb=0.01", f"--api-key={KEY}",
             "--header-timeout=2")
  s.eos = {str(t): -100 for t in Tokenizer.from_gguf_metadata(open_gguf(path).metadata).stop_ids}
  yield s
  if s.proc.poll() is None:
    assert s.stop() == 0, s.stderr()


def scrape(s) -> dict:
  """{(sample name, sorted labels): value} of /metrics."""
  r = httpx.get(s.url + "/metrics", headers=AUTH, timeout=30)
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
  return {(x.name, tuple(sorted(x.labels.items()))): x.value
          for fam in text_string_to_metric_families(r.text) for x in fam.samples}


def val(m: dict, name: str, **labels) -> float:
  return m.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(a: dict, b: dict, name: str, **labels) -> float:
  return val(b, name, **labels) - val(a, name, **labels)


def server_fds(s) -> int:
  return len(os.listdir(f"/proc/{s.proc.pid}/fd"))


def server_rss(s) -> int:
  with open(f"/proc/{s.proc.pid}/status") as f:
    return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) << 10


def wait_for(cond, seconds: float, what: str):
  deadline = time.time() + seconds
  while not cond():
    assert time.time() < deadline, what
    time.sleep(0.05)


def completion(s, stream: bool, max_tokens: int, prompt="One two three") -> dict:
  return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
          "logit_bias": s.eos}


def raw_request(s, body: dict) -> socket.socket:
  """A POST /v1/completions written on a plain socket (the caller closes it to leave)."""
  data = json.dumps(body).encode()
  sock = socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])))
  sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
               + data)
  return sock


def pieces(lines: list[str]) -> list:
  """(text, finish reason) of each SSE chunk of a completions stream, then its end marker."""
  assert lines[-1] == "data: [DONE]"
  out = [json.loads(l[len("data:"):]) for l in lines[:-1]]
  return [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in out]


def test_metrics_need_the_key_and_count_what_the_clients_saw(ops):
  assert httpx.get(ops.url + "/metrics").status_code == 401
  c = openai.OpenAI(base_url=ops.url + "/v1", api_key=KEY, max_retries=0)
  before, health0 = scrape(ops), httpx.get(ops.url + "/health").json()
  first = list(range(200, 240))
  usages = []
  # the second prompt starts with the first (whose end the prefix cache keeps)
  for n, prompt in ((5, first), (7, first + list(range(260, 270)))):
    r = c.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                             logit_bias=ops.eos)
    usages.append(r.usage)
  chunks = list(c.chat.completions.create(
      model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
      stream=True, stream_options={"include_usage": True}, logit_bias=ops.eos))
  usages.append(chunks[-1].usage)
  bad = httpx.post(ops.url + "/v1/completions", headers=AUTH, json={"prompt": "a",
                                                                    "max_tokens": -1})
  assert bad.status_code == 400
  after, health1 = scrape(ops), httpx.get(ops.url + "/health").json()

  made = [u.completion_tokens for u in usages]
  assert made == [5, 7, 6]
  d = lambda name, **kw: delta(before, after, name, **kw)
  assert d("jaxvt:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
  assert d("jaxvt:generation_tokens_total") == sum(made)
  assert d("jaxvt:request_success_total", finished_reason="length") == 3
  assert d("jaxvt:time_to_first_token_seconds_count") == 3
  assert d("jaxvt:time_to_first_token_seconds_sum") > 0
  assert d("jaxvt:inter_token_latency_seconds_count") == sum(made) - 3
  assert d("jaxvt:e2e_request_latency_seconds_count") == 3
  assert d("jaxvt:request_queue_time_seconds_count") == 3
  assert d("jaxvt:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
  cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
  assert cached > 0 and d("jaxvt:prefix_cache_hits_total") == cached
  assert d("http_requests_total", method="POST", handler="/v1/completions", status="200") == 2
  assert d("http_requests_total", method="POST", handler="/v1/completions", status="400") == 1
  assert d("http_requests_total", method="POST", handler="/v1/chat/completions",
           status="200") == 1
  assert val(after, "jaxvt:num_requests_running") == 0
  assert val(after, "jaxvt:num_requests_waiting") == 0 and val(after, "jaxvt:num_slots") == 1
  # the expert cache's counters, as /health reports them
  xs0, xs1 = health0["expert_cache"], health1["expert_cache"]
  assert d("jaxvt:expert_cache_hits_total") >= xs1["hits"] - xs0["hits"] > 0
  assert d("jaxvt:expert_cache_misses_total") >= xs1["misses"] - xs0["misses"]
  # a filled expert is read once a call however many slots route to it
  assert 0 < xs1["fills"] - xs0["fills"] <= xs1["misses"] - xs0["misses"]
  assert 0 < val(after, "jaxvt:expert_cache_fill_bytes_total") <= val(
      after, "jaxvt:expert_cache_host_bytes_total")
  assert val(after, "jaxvt:expert_cache_hit_bytes_total") > 0

  # one access line per request, with the tokens the client was told of
  lines = ops.stderr()
  for u, path in zip(usages, ("/v1/completions",) * 2 + ("/v1/chat/completions",)):
    want = (rf'"POST {path}" 200 prompt={u.prompt_tokens} '
            rf'cached={u.prompt_tokens_details.cached_tokens} completion={u.completion_tokens} '
            r'finish=length ttft=\d+\.\d+s time=\d+\.\d+s')
    assert re.search(want, lines), (want, lines[-2000:])
  assert re.search(r'"POST /v1/completions" 400 time=', lines)


def test_a_thousand_silent_connections_are_closed_and_the_others_served(ops):
  # the server's memory is taken after a first request (its programs compiled), so the bound is
  # on what the connections cost whichever test runs first
  httpx.post(ops.url + "/v1/completions", headers=AUTH, timeout=60,
             json=completion(ops, False, 4)).raise_for_status()
  fds0, rss0 = server_fds(ops), server_rss(ops)
  port = int(ops.url.rsplit(":", 1)[1])
  silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
  try:
    wait_for(lambda: server_fds(ops) > fds0 + 900, 30, "the server accepted them")
    t = time.monotonic()
    r = httpx.post(ops.url + "/v1/completions", headers=AUTH, timeout=60,
                   json=completion(ops, False, 4))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t < 30
    # --header-timeout 2: each is closed by the server (EOF) within a few seconds. (A selector,
    # not select(): a process with many files open gives these sockets numbers past select's 1024.)
    pending, deadline = set(silent), time.time() + 30
    with selectors.DefaultSelector() as sel:
      for sock in silent:
        sel.register(sock, selectors.EVENT_READ)
      while pending and time.time() < deadline:
        for key, _ in sel.select(0.5):
          sock = key.fileobj
          assert sock.recv(16) == b""
          pending.discard(sock)
          sel.unregister(sock)
    assert not pending, f"{len(pending)} connections still open"
  finally:
    for sock in silent:
      sock.close()
  wait_for(lambda: server_fds(ops) <= fds0 + 2, 10, "the server's sockets are closed")
  assert server_rss(ops) - rss0 < 64 << 20


def test_a_slow_reader_gets_its_whole_stream_and_does_not_hold_the_engine(ops):
  """A stream read at 2.5 KB/s through a 2 KB receive window (the generation makes more): a
  request behind it in the queue is served while the stream is still being read, and the
  stream, once read, is the one a fast reader gets."""
  body = completion(ops, True, 300, prompt="Tell me a story")
  with httpx.stream("POST", ops.url + "/v1/completions", headers=AUTH, json=body,
                    timeout=120) as r:
    fast = [l for l in r.iter_lines() if l.startswith("data:")]
  fds0 = server_fds(ops)
  small = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)])
  got, other = [], {}

  def meanwhile():  # waits for the slot, which the generation frees, not the reading
    other["r"] = httpx.post(ops.url + "/v1/completions", headers=AUTH, timeout=120,
                            json=completion(ops, False, 3))
    other["read"] = len(got)

  with httpx.Client(transport=small, timeout=120) as slow:
    with slow.stream("POST", ops.url + "/v1/completions", headers=AUTH, json=body) as r:
      th = threading.Thread(target=meanwhile)
      th.start()
      start = time.monotonic()
      for piece in r.iter_raw(256):
        got.append(piece)
        if "read" not in other and time.monotonic() - start < 90:
          time.sleep(0.1)  # slowly until the other request is served
  th.join(120)
  text = b"".join(got).decode()
  assert pieces([l for l in text.splitlines() if l.startswith("data:")]) == pieces(fast)
  assert other["r"].status_code == 200
  assert other["read"] < len(got), "the other request waited for the reader"
  m = scrape(ops)
  assert val(m, "jaxvt:num_requests_running") == 0 and val(m, "jaxvt:num_requests_waiting") == 0
  wait_for(lambda: server_fds(ops) <= fds0 + 2, 10, "the slow reader's socket is closed")


def test_requests_cancelled_in_the_queue_never_run(ops):
  """One slot: a long stream holds it; a non-streamed and a streamed request queue behind it and
  their clients leave. Both leave the queue at once (the long one still decoding) and never get
  a token; the next request is served."""
  before = scrape(ops)
  long = httpx.stream("POST", ops.url + "/v1/completions", headers=AUTH, timeout=120,
                      json=completion(ops, True, 1000))
  r = long.__enter__()
  lines = r.iter_lines()
  assert next(l for l in lines if l.startswith("data:"))  # it decodes: the slot is taken
  for stream in (False, True):
    sock = raw_request(ops, completion(ops, stream, 50))
    wait_for(lambda: val(scrape(ops), "jaxvt:num_requests_waiting") == 1, 30, "queued")
    sock.close()
    wait_for(lambda: val(scrape(ops), "jaxvt:num_requests_waiting") == 0, 10, "left the queue")
    assert val(scrape(ops), "jaxvt:num_requests_running") == 1  # the long one goes on
  long.__exit__(None, None, None)  # its client leaves too
  wait_for(lambda: val(scrape(ops), "jaxvt:num_requests_running") == 0, 30, "slot freed")
  r = httpx.post(ops.url + "/v1/completions", headers=AUTH, timeout=60,
                 json=completion(ops, False, 3))
  assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
  after = scrape(ops)
  assert delta(before, after, "jaxvt:request_success_total", finished_reason="abort") == 3
  # only the long request and the last one were given a slot and a first token
  assert delta(before, after, "jaxvt:request_queue_time_seconds_count") == 2
  assert delta(before, after, "jaxvt:time_to_first_token_seconds_count") == 2
  assert len(re.findall(r"cancelled: the client disconnected", ops.stderr())) >= 3


def test_a_stream_nobody_reads_ends_at_the_send_timeout():
  """SendTimeout over a StreamingResponse whose client stops taking bytes: the response ends
  within the timeout and its generator is closed (where the server cancels the request)."""
  closed = []

  async def events():
    try:
      for i in range(1000):
        yield f"data: {i}\n\n"
    finally:
      closed.append(True)

  async def main():
    sent = []

    async def send(message):
      sent.append(message)
      if len(sent) > 3:
        await asyncio.sleep(3600)  # the client's window stays full

    async def receive():
      await asyncio.sleep(3600)
      return {"type": "http.disconnect"}

    app = SendTimeout(StreamingResponse(events(), media_type="text/event-stream"), seconds=0.5)
    t = time.monotonic()
    with pytest.raises(Exception) as e:
      await asyncio.wait_for(app({"type": "http", "method": "GET", "path": "/",
                                  "headers": [], "asgi": {"spec_version": "2.4"}},
                                 receive, send), 10)
    return time.monotonic() - t, e.value, len(sent)

  took, err, n = asyncio.run(main())
  # TimeoutError is an OSError: Starlette reports a failed send as the client gone
  assert type(err).__name__ in ("TimeoutError", "ClientDisconnect"), repr(err)
  assert 0.45 < took < 5 and n == 4 and closed == [True]
