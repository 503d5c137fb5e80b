"""Starlette routes of the OpenAI-compatible API over an EngineLoop: GET /health and /v1/models,
POST /v1/completions and /v1/chat/completions (streamed as server-sent events with
`"stream": true`), with OpenAI-style JSON errors. Every request is checked as the CLI checks its
flags (jaxvt.inputs); a refused request is one log line and an error body, and the server goes on
serving the others."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jaxvt import inputs
from jaxvt.engine import expert_cache_stats
from jaxvt.errors import JaxvtError
from jaxvt.serve import schema
from jaxvt.serve.logprobs import CompletionLogprobs, chat_content
from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.scheduler import QueueFull, Request

log = logging.getLogger("jaxvt.serve")
MAX_BODY = 1 << 20
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ApiError(Exception):
  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None):
    super().__init__(message)
    self.status, self.kind, self.param = status, kind, param


def _error(e: ApiError) -> JSONResponse:
  log.warning("%d %s", e.status, e)
  headers = {"Retry-After": "1"} if e.status == 429 else None
  return JSONResponse({"error": {"message": str(e), "type": e.kind, "param": e.param,
                                 "code": None}},
                      status_code=e.status, headers=headers)


def unsupported(data: schema.ChatRequest) -> None:
  """Declared fields the server does not act on: refused with a 400 naming them, never
  silently ignored."""
  if data.response_format is not None and data.response_format.type != "text":
    raise ApiError(400, f"response_format: type {data.response_format.type!r} is not supported",
                   param="response_format")
  if data.tools:
    raise ApiError(400, "tools: tool calls are not supported", param="tools")


def structured(data: schema.ChatRequest) -> dict:
  """The Request fields a constrained decoder acts on, as plain dicts."""
  return {"response_format": None if data.response_format is None else
          data.response_format.model_dump(by_alias=True, exclude_none=True),
          "tools": None if data.tools is None else [t.model_dump(exclude_none=True)
                                                   for t in data.tools],
          "tool_choice": (data.tool_choice.model_dump() if isinstance(
              data.tool_choice, schema.NamedToolChoice) else data.tool_choice),
          "parallel_tool_calls": data.parallel_tool_calls}


def build(engine, loop: EngineLoop, model_id: str, api_key: str | None = None,
          info: dict | None = None) -> Starlette:
  """The application. With `api_key`, every /v1 request needs `Authorization: Bearer KEY`.
  /health reports the requests in flight, `info` (how the server sized itself), the device's
  memory (bytes in use and the peak, where the platform reports them), the prefix cache's
  entries, bytes and hits, and the expert cache's hits and misses."""
  tok = engine.tokenizer
  eos = frozenset(tok.stop_ids)

  def authorize(req: HttpRequest) -> None:
    if api_key is not None:
      given = req.headers.get("authorization", "")
      if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                       "authentication_error")

  async def body(req: HttpRequest, model: type):
    """The request's body validated as `model` (jaxvt.serve.schema)."""
    authorize(req)
    declared = req.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:  # refused before it is read
      raise ApiError(413, f"the body has {declared} bytes, more than {MAX_BODY}")
    raw = await req.body()
    if len(raw) > MAX_BODY:
      raise ApiError(413, f"the body has {len(raw)} bytes, more than {MAX_BODY}")
    try:
      return schema.parse(raw, model, engine.cfg.vocab_size)
    except schema.BodyError as e:
      raise ApiError(e.status, str(e), param=e.param) from None

  def request(ids: list[int], data, default_tokens: int | None, **extra) -> Request:
    """The Request of a validated body `data` (and `extra` Request fields). A max_tokens beyond
    the room the context leaves is clamped to that room: such a generation ends with
    finish_reason "length"."""
    if len(ids) + 1 > engine.max_context:
      raise ApiError(400, f"the prompt has {len(ids)} tokens, more than --max-context "
                     f"{engine.max_context} allows")
    room = engine.max_context - len(ids)
    mt = min(data.max_tokens or default_tokens or room, room)
    seed = data.seed if data.seed is not None else secrets.randbits(63)
    return Request(prompt=ids, max_tokens=mt, eos_ids=eos, stop=data.stop,
                   temperature=data.temperature,
                   top_k=inputs.top_k_for(data.top_k, engine.cfg.vocab_size), top_p=data.top_p,
                   seed=seed, decoder=tok.stream_decoder(), logit_bias=dict(data.logit_bias),
                   frequency_penalty=data.frequency_penalty,
                   presence_penalty=data.presence_penalty, logprobs=data.alternatives, **extra)

  def submit(r: Request):
    """Queues `r`; returns an asyncio queue that receives (new text, done, how many of its
    token_logprobs there are with that text) from the loop."""
    aloop, q = asyncio.get_running_loop(), asyncio.Queue()
    r.listener = lambda r: aloop.call_soon_threadsafe(
        q.put_nowait, (r.release(), r.done, len(r.token_logprobs)))
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

  async def respond(r: Request, data, chat: bool):
    q = submit(r)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{r.id}", "created": int(time.time()),
            "model": model_id}
    want_lps = r.logprobs is not None
    legacy = CompletionLogprobs(tok)
    sent = 0  # token_logprobs sent so far

    def lps(upto: int) -> dict | None:
      """The logprobs object of token_logprobs[sent:upto] (None without logprobs)."""
      nonlocal sent
      if not want_lps:
        return None
      entries = list(zip(r.tokens[sent:upto], r.token_logprobs[sent:upto]))
      sent = upto
      return {"content": chat_content(tok, entries)} if chat else legacy.take(entries)

    if not data.stream:
      while not (await q.get())[1]:
        pass
      choice = {"index": 0, "finish_reason": finish_reason(r), "logprobs": lps(len(r.tokens))}
      if chat:
        choice["message"] = {"role": "assistant", "content": r.text}
      else:
        choice["text"] = r.text
      return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                           "choices": [choice], "usage": usage(r)})
    kind = "chat.completion.chunk" if chat else "text_completion"
    with_usage = data.include_usage

    def chunk(piece: str | None, reason: str | None, delta: dict | None = None,
              logprobs: dict | None = None) -> str:
      if chat:
        choice = {"index": 0, "delta": delta or ({} if piece is None else {"content": piece}),
                  "logprobs": logprobs, "finish_reason": reason}
      else:
        choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": logprobs}
      return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"

    async def events():
      try:
        if chat:
          yield chunk(None, None, {"role": "assistant", "content": ""})
        while True:
          piece, done, n_lps = await q.get()
          if piece:
            yield chunk(piece, None, logprobs=lps(n_lps))
          if done:
            break
        try:
          reason = finish_reason(r)
          yield chunk(None, reason, logprobs=lps(len(r.token_logprobs)) if sent < len(
              r.token_logprobs) else None)
        except ApiError as e:
          yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind}})}\n\n"
        if with_usage:
          yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': usage(r)})}\n\n"
        yield "data: [DONE]\n\n"
      finally:
        if not r.done:  # the client went away mid-stream
          log.info("request %d cancelled: the client disconnected", r.id)
          loop.cancel(r)

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
    data = await body(req, schema.CompletionRequest)
    ids = data.prompt if isinstance(data.prompt, list) else tok.encode(data.prompt)
    return await respond(request(ids, data, COMPLETION_DEFAULT_TOKENS), data, chat=False)

  @answering
  async def chat(req: HttpRequest):
    data = await body(req, schema.ChatRequest)
    unsupported(data)
    msgs = data.template_messages()
    # the file's template, rendered in a limited child process (jaxvt.gguf.chat_template)
    text = await asyncio.get_running_loop().run_in_executor(None, tok.apply_chat_template,
                                                            msgs)
    r = request(tok.encode(text), data, None, **structured(data))
    return await respond(r, data, chat=True)

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

  return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                           Route("/v1/completions", completions, methods=["POST"]),
                           Route("/v1/chat/completions", chat, methods=["POST"])])

