"""Starlette routes of the OpenAI-compatible API over an EngineLoop: GET /health, /metrics
(Prometheus, jaxvt.serve.metrics) and /v1/models,
POST /v1/completions and /v1/chat/completions (streamed as server-sent events with
`"stream": true`), with OpenAI-style JSON errors. Every request is checked as the CLI checks its
flags (jaxvt.inputs); a refused request is one log line and an error body, and the server goes on
serving the others."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import time
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxvt import inputs
from jaxvt.engine import expert_cache_stats
from jaxvt.errors import JaxvtError
from jaxvt.serve.limits import SendTimeout, wait_or_gone
from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.metrics import AccessLog, Metrics
from jaxvt.serve.scheduler import QueueFull, Request

log = logging.getLogger("jaxvt.serve")
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
          "stream_options", "user", "logit_bias"}
MAX_BODY = 1 << 20
MAX_STOPS = 4
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ApiError(Exception):
  def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.kind = status, kind


def _error(e: ApiError) -> JSONResponse:
  log.warning("%d %s", e.status, e)
  headers = {"Retry-After": "1"} if e.status == 429 else None
  return JSONResponse({"error": {"message": str(e), "type": e.kind, "param": None, "code": None}},
                      status_code=e.status, headers=headers)


def _finite(x: Any) -> None:
  if isinstance(x, float) and not math.isfinite(x):
    raise ApiError(400, "numbers must be finite")
  if isinstance(x, dict):
    for v in x.values():
      _finite(v)
  if isinstance(x, list):
    for v in x:
      _finite(v)


def _text_of(content: Any) -> str:
  """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in content):
    return "".join(p["text"] for p in content)
  raise ApiError(400, "a message's content must be a string or a list of text parts")


def _messages(data: dict) -> list[dict]:
  msgs = data.get("messages")
  if not isinstance(msgs, list) or not msgs or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
    raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
  return [{**m, "content": _text_of(m.get("content"))} for m in msgs]


def _stops(value: Any) -> tuple[str, ...]:
  stop = () if value is None else (value,) if isinstance(value, str) else value
  if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOPS or not all(
      isinstance(s, str) and s for s in stop):
    raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS}")
  return tuple(stop)


def _logit_bias(value: Any, vocab: int) -> dict[int, float]:
  """OpenAI's logit_bias: {"token id": bias in [-100, 100]}."""
  if value is None:
    return {}
  if not isinstance(value, dict):
    raise ApiError(400, "logit_bias must be an object of token id -> bias")
  out = {}
  for k, v in value.items():
    if not (k.isdigit() and int(k) < vocab) or isinstance(v, bool) or not isinstance(
        v, (int, float)) or not -100 <= v <= 100:
      raise ApiError(400, f"logit_bias: {k!r}: {v!r} must map a token id below {vocab} to a "
                     "number in [-100, 100]")
    out[int(k)] = float(v)
  return out


def build(engine, loop: EngineLoop, model_id: str, api_key: str | None = None,
          info: dict | None = None, send_timeout: float = 60.0) -> Starlette:
  """The application. With `api_key`, every /v1 request and /metrics need `Authorization: Bearer
  KEY`. A response write that waits more than `send_timeout` seconds for the client ends it.
  /health reports the requests in flight, `info` (how the server sized itself), the device's
  memory (bytes in use and the peak, where the platform reports them), the prefix cache's
  entries, bytes and hits, and the expert cache's hits and misses."""
  tok = engine.tokenizer
  eos = frozenset(tok.stop_ids)
  metrics = Metrics(loop, engine, loop.sched.max_batch)
  loop.observer = metrics

  def authorize(req: HttpRequest) -> None:
    if api_key is not None:
      given = req.headers.get("authorization", "")
      if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                       "authentication_error")

  async def body(req: HttpRequest, allowed: set[str]) -> dict:
    authorize(req)
    declared = req.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:  # refused before it is read
      raise ApiError(413, f"the body has {declared} bytes, more than {MAX_BODY}")
    raw = await req.body()
    if len(raw) > MAX_BODY:
      raise ApiError(413, f"the body has {len(raw)} bytes, more than {MAX_BODY}")
    try:
      data = json.loads(raw)
    except ValueError as e:
      raise ApiError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
      raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(data) - allowed)
    if unknown:
      raise ApiError(400, f"unknown fields: {', '.join(unknown)}")
    _finite(data)
    if data.get("n", 1) != 1:
      raise ApiError(400, "only n=1 is supported")
    return data

  def request(ids: list[int], data: dict, default_tokens: int | None) -> Request:
    if len(ids) + 1 > engine.max_context:
      raise ApiError(400, f"the prompt has {len(ids)} tokens, more than --max-context "
                     f"{engine.max_context} allows")
    room = engine.max_context - len(ids)
    try:
      mt = data.get("max_tokens")
      mt = min(inputs.max_tokens(mt), room) if mt is not None else min(default_tokens or room,
                                                                         room)
      t, k, p = inputs.sampling(data.get("temperature", 1.0), data.get("top_k", 0),
                                data.get("top_p", 1.0))
      seed = (inputs.seed(data["seed"]) if data.get("seed") is not None else
              secrets.randbits(63))
    except JaxvtError as e:
      raise ApiError(400, str(e)) from None
    return Request(prompt=ids, max_tokens=mt, eos_ids=eos, stop=_stops(data.get("stop")),
                   temperature=t, top_k=inputs.top_k_for(k, engine.cfg.vocab_size), top_p=p,
                   seed=seed, decoder=tok.stream_decoder(),
                   logit_bias=_logit_bias(data.get("logit_bias"), engine.cfg.vocab_size))

  def submit(r: Request):
    """Queues `r`; returns an asyncio queue that receives (new text, done) from the loop."""
    aloop, q = asyncio.get_running_loop(), asyncio.Queue()
    r.listener = lambda r: aloop.call_soon_threadsafe(q.put_nowait, (r.release(), r.done))
    try:
      loop.submit(r)
    except QueueFull as e:
      raise ApiError(429, str(e), "rate_limit_error") from None
    except RuntimeError as e:
      raise ApiError(503, str(e), "server_error") from None
    return q

  def usage(r: Request) -> dict:
    return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens),
            "total_tokens": len(r.prompt) + len(r.tokens),
            "prompt_tokens_details": {"cached_tokens": r.cached}}

  def finish_reason(r: Request) -> str:
    if r.finish_reason == "error":
      raise ApiError(500, f"the engine failed: {loop.error}", "server_error")
    return r.finish_reason

  async def respond(r: Request, data: dict, chat: bool):
    q = submit(r)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{r.id}", "created": int(time.time()),
            "model": model_id}
    if not data.get("stream"):
      if not await wait_or_gone(q, lambda: loop.cancel(r)):
        log.info("request %d cancelled: the client disconnected", r.id)
        return Response(status_code=499)  # nobody is there to read it
      choice = {"index": 0, "finish_reason": finish_reason(r)}
      if chat:
        choice["message"] = {"role": "assistant", "content": r.text}
      else:
        choice.update(text=r.text, logprobs=None)
      return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                           "choices": [choice], "usage": usage(r)})
    kind = "chat.completion.chunk" if chat else "text_completion"
    with_usage = bool((data.get("stream_options") or {}).get("include_usage"))

    def chunk(piece: str | None, reason: str | None, delta: dict | None = None) -> str:
      if chat:
        choice = {"index": 0, "delta": delta or ({} if piece is None else {"content": piece}),
                  "finish_reason": reason}
      else:
        choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
      return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"

    async def events():
      try:
        if chat:
          yield chunk(None, None, {"role": "assistant", "content": ""})
        while True:
          piece, done = await q.get()
          if piece:
            yield chunk(piece, None)
          if done:
            break
        try:
          yield chunk(None, finish_reason(r))
        except ApiError as e:
          yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind}})}\n\n"
        if with_usage:
          yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': usage(r)})}\n\n"
        yield "data: [DONE]\n\n"
      finally:
        if not r.done:  # the client went away mid-stream
          log.info("request %d cancelled: the client disconnected", r.id)
          loop.cancel(r)

    # Server-sent events are framed here, not by sse-starlette: importing it replaces uvicorn's
    # Server.handle_exit for the whole process so that SIGTERM ends every open stream at once,
    # where this server lets the requests in flight finish (--drain-seconds); the framing it
    # would take over is one line a chunk.
    return StreamingResponse(events(), media_type="text/event-stream")

  def answering(handler):
    """`handler`'s ApiError or JaxvtError (a bad request) as an OpenAI error response."""
    async def answer(req: HttpRequest):
      try:
        return await handler(req)
      except JaxvtError as e:
        return _error(ApiError(400, str(e)))
      except ApiError as e:
        return _error(e)
    return answer

  @answering
  async def completions(req: HttpRequest):
    data = await body(req, COMMON | {"prompt"})
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
      ids = inputs.token_ids(prompt, engine.cfg.vocab_size, "prompt")
    elif isinstance(prompt, str) and prompt:
      ids = tok.encode(prompt)
    else:
      raise ApiError(400, "prompt must be a non-empty string or list of token ids")
    return await respond(request(ids, data, COMPLETION_DEFAULT_TOKENS), data, chat=False)

  @answering
  async def chat(req: HttpRequest):
    data = await body(req, COMMON | {"messages"})
    msgs = _messages(data)
    # the file's template, rendered in a limited child process (jaxvt.gguf.chat_template)
    text = await asyncio.get_running_loop().run_in_executor(None, tok.apply_chat_template,
                                                            msgs)
    return await respond(request(tok.encode(text), data, None), data, chat=True)

  @answering
  async def models(req: HttpRequest):
    authorize(req)
    return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model",
                                                     "owned_by": "jaxvt", "created": 0}]})

  async def health(_):
    if loop.error is not None:
      return JSONResponse({"status": "error", "error": str(loop.error)}, status_code=503)
    stats = engine.ex.par.devices[0].memory_stats() or {}
    memory = {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
              if k in stats}
    pc = loop.session.prefix
    reuse = {} if pc is None else {"entries": len(pc), "bytes": pc.nbytes, "hits": pc.hits,
                                   "reused_tokens": pc.reused_tokens}
    xs = expert_cache_stats(engine.weights)
    experts = {} if xs is None else {"hits": xs.hits, "misses": xs.misses,
                                     "hit_rate": round(xs.hit_rate, 4)}
    return JSONResponse({"status": "ok", "requests": loop.counts(), "serve": info or {},
                         "memory": memory, "prefix_cache": reuse, "expert_cache": experts})

  @answering
  async def prometheus(req: HttpRequest):
    authorize(req)
    text, content_type = metrics.exposition()
    return Response(text, headers={"Content-Type": content_type})

  routes = [Route("/health", health), Route("/metrics", prometheus), Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"])]
  return Starlette(routes=routes, middleware=[
      Middleware(AccessLog, metrics=metrics, handlers=frozenset(r.path for r in routes)),
      Middleware(SendTimeout, seconds=send_timeout)])

