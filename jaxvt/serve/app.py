"""Starlette routes of the OpenAI-compatible API over an EngineLoop: GET /health, /metrics
(Prometheus, jaxvt.serve.metrics) and /v1/models,
POST /v1/completions and /v1/chat/completions (streamed as server-sent events with
`"stream": true`), with OpenAI-style JSON errors. Every request is checked as the CLI checks its
flags (jaxvt.inputs); a refused request is one log line and an error body, and the server goes on
serving the others."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import secrets
import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxvt import inputs
from jaxvt.engine import expert_cache_stats
from jaxvt.errors import JaxvtError
from jaxvt.serve import schema, structured, tools
from jaxvt.serve.limits import SendTimeout, wait_or_gone
from jaxvt.serve.logprobs import CompletionLogprobs, chat_content
from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.metrics import AccessLog, Metrics
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

  def request(ids: list[int], data, default_tokens: int | None) -> Request:
    """The Request of a validated body `data`. A max_tokens beyond the room the context leaves is
    clamped to that room: such a generation ends with finish_reason "length"."""
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
                   presence_penalty=data.presence_penalty, logprobs=data.alternatives)

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

  async def respond(r: Request, data, chat: bool, plan: tools.Plan | None = None):
    """Answers `r`; with `plan` (tools offered and read back), the answer's tool calls are
    `tool_calls` (streamed as OpenAI streams them: the call's id and name, then its arguments
    in fragments) and finish_reason is "tool_calls"."""
    reading = plan is not None and plan.parse
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
      if not await wait_or_gone(q, lambda: loop.cancel(r)):
        log.info("request %d cancelled: the client disconnected", r.id)
        return Response(status_code=499)  # nobody is there to read it
      choice = {"index": 0, "finish_reason": finish_reason(r), "logprobs": lps(len(r.tokens))}
      if chat:
        choice["message"] = {"role": "assistant", "content": r.text}
        if reading:
          content, calls = tools.read(r.text, plan.names, plan.parallel)
          choice["message"]["content"] = content
          if calls:
            choice["message"]["tool_calls"] = calls
            if choice["finish_reason"] == "stop":
              choice["finish_reason"] = "tool_calls"
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

    reader = tools.Reader(plan.names, plan.parallel) if reading else None

    def deltas(events, n_lps: int) -> list[str]:
      """A tool Reader's events as chunks (the logprobs of their tokens with the first)."""
      out = []
      for kind, x in events:
        lp = None if out else lps(n_lps)
        if kind == "content":
          out.append(chunk(x, None, logprobs=lp))
          continue
        i = len(reader.calls) - 1
        fn = x["function"]
        head_delta = {"tool_calls": [{"index": i, "id": x["id"], "type": "function",
                                      "function": {"name": fn["name"], "arguments": ""}}]}
        out.append(chunk(None, None, head_delta, logprobs=lp))
        out += [chunk(None, None, {"tool_calls": [{"index": i, "function": {"arguments": a}}]})
                for a in tools.argument_pieces(fn["arguments"])]
      return out

    async def events():
      try:
        if chat:
          yield chunk(None, None, {"role": "assistant", "content": ""})
        while True:
          piece, done, n_lps = await q.get()
          if piece and reader:
            for c in deltas(reader.feed(piece), n_lps):
              yield c
          elif piece:
            yield chunk(piece, None, logprobs=lps(n_lps))
          if done:
            break
        for c in deltas(reader.close(), len(r.token_logprobs)) if reader else []:
          yield c
        try:
          reason = finish_reason(r)
          reason = "tool_calls" if reader and reader.calls and reason == "stop" else reason
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
    data = await body(req, schema.CompletionRequest)
    ids = data.prompt if isinstance(data.prompt, list) else tok.encode(data.prompt)
    return await respond(request(ids, data, COMPLETION_DEFAULT_TOKENS), data, chat=False)

  @answering
  async def chat(req: HttpRequest):
    data = await body(req, schema.ChatRequest)
    offered = [t.model_dump(exclude_none=True) for t in data.tools] if data.tools else None
    choice = data.tool_choice
    choice = choice.model_dump() if isinstance(choice, schema.NamedToolChoice) else choice
    fmt = data.response_format.model_dump(by_alias=True) if data.response_format else None
    try:
      plan = tools.plan(data.template_messages(), offered, choice, data.parallel_tool_calls,
                        tok.chat_template)
      grammar = plan.grammar or structured.response_format_grammar(fmt)
    except tools.ToolsError as e:
      raise ApiError(400, str(e), param="tools") from None
    except structured.ConstraintError as e:
      raise ApiError(400, f"response_format: {e}", param="response_format") from None
    run = asyncio.get_running_loop().run_in_executor
    # the file's template, rendered in a limited child process (jaxvt.gguf.chat_template)
    text = await run(None, functools.partial(tok.apply_chat_template, plan.messages,
                                             **plan.template_kwargs))
    r = request(tok.encode(text), data, None)
    if grammar is not None:
      try:  # the first one builds the vocabulary's index (seconds for a large vocabulary)
        r.constraint = await run(None, structured.Constraint, tok, grammar)
      except structured.ConstraintError as e:
        field = "response_format" if plan.grammar is None else "tools"
        raise ApiError(400, f"{field}: {e}", param=field) from None
    return await respond(r, data, chat=True, plan=plan)

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
    experts = {} if xs is None else {"hits": xs.hits, "misses": xs.misses, "fills": xs.fills,
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

