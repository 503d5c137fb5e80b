"""A real server process on a free localhost port, driven by the openai client and httpx."""

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def url():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  p = subprocess.Popen([sys.executable, "-m", "jaxvt.serve", f"--port={port}", "--max_context=256"],
                       cwd=os.path.dirname(os.path.dirname(__file__)))
  base = f"http://127.0.0.1:{port}"
  for _ in range(240):
    try:
      if httpx.get(base + "/health").status_code == 200:
        break
    except httpx.TransportError:
      time.sleep(0.5)
  yield base
  p.terminate()
  rc = p.wait(60)
  assert rc == 0, rc


def test_openai_client_both_endpoints(url):
  c = openai.OpenAI(base_url=url + "/v1", api_key="x")
  r = c.completions.create(model="m", prompt="The capital of France is", max_tokens=5)
  assert r.choices[0].text and r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 5
  r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                max_tokens=5)
  assert r.choices[0].message.content is not None and r.usage.completion_tokens <= 5
  assert c.models.list().data[0].id


@pytest.mark.parametrize("content,status", [
    (b"{not json", 400), (b'{"prompt": "a", "bogus": 1}', 400),
    (b'{"prompt": "a", "temperature": NaN}', 400), (b'{"prompt": "' + b"a b " * 400 + b'"}', 400),
    (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413)])
def test_bad_input_gives_openai_error(url, content, status):
  r = httpx.post(url + "/v1/completions", content=content, timeout=60)
  assert r.status_code == status and r.json()["error"]["message"]
  assert httpx.get(url + "/health").status_code == 200


def test_eight_concurrent_clients_equal_their_solo_answers(url):
  from concurrent.futures import ThreadPoolExecutor
  prompts = [f"Count from {i}:" for i in range(8)]

  def ask(p):
    r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 8}, timeout=120)
    return r.json()["choices"][0]["text"]

  solo = [ask(p) for p in prompts]
  with ThreadPoolExecutor(8) as ex:
    together = list(ex.map(ask, prompts))
  assert together == solo
