"""Starlette routes of the OpenAI-compatible API over an EngineLoop: /health, /v1/models,
/v1/completions and /v1/chat/completions (non-streaming, greedy), with OpenAI-style errors."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.scheduler import QueueFull, Request

log = logging.getLogger("jaxvt.serve")
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
          "user"}
MAX_BODY = 1 << 20


class ApiError(Exception):
  def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.kind = status, kind


def _error(e: ApiError) -> JSONResponse:
  log.warning("%d %s", e.status, e)
  headers = {"Retry-After": "1"} if e.status == 429 else None
  return JSONResponse({"error": {"message": str(e), "type": e.kind, "param": None, "code": None}},
                      status_code=e.status, headers=headers)


def _finite(x):
  if isinstance(x, float) and not math.isfinite(x):
    raise ApiError(400, "numbers must be finite")
  if isinstance(x, dict):
    for v in x.values():
      _finite(v)
  if isinstance(x, list):
    for v in x:
      _finite(v)


def build(engine, loop: EngineLoop, model_id: str) -> Starlette:
  tok = engine.tokenizer
  eos = frozenset(getattr(tok, "eog_ids", ()) or ())

  async def body(req: HttpRequest, allowed: set[str]) -> dict:
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
    if data.get("stream"):
      raise ApiError(400, "stream is not supported by this server yet")
    if data.get("n", 1) != 1:
      raise ApiError(400, "only n=1 is supported")
    return data

  async def run(ids: list[int], data: dict) -> Request:
    if len(ids) + 1 > engine.max_context:
      raise ApiError(400, f"the prompt has {len(ids)} tokens, more than --max-context "
                     f"{engine.max_context} allows")
    mt = data.get("max_tokens") or 16
    if not isinstance(mt, int) or mt < 1:
      raise ApiError(400, "max_tokens must be a positive integer")
    mt = min(mt, engine.max_context - len(ids))
    stop = data.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    r = Request(prompt=ids, max_tokens=mt, eos_ids=eos, stop=stop)
    try:
      ev = loop.submit(r)
    except QueueFull as e:
      raise ApiError(429, str(e), "rate_limit_error") from None
    await asyncio.get_running_loop().run_in_executor(None, ev.wait)
    return r

  def usage(r: Request) -> dict:
    return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens),
            "total_tokens": len(r.prompt) + len(r.tokens),
            "prompt_tokens_details": {"cached_tokens": 0}}

  async def completions(req: HttpRequest):
    try:
      data = await body(req, COMMON | {"prompt"})
      if not isinstance(data.get("prompt"), str):
        raise ApiError(400, "prompt must be a string")
      r = await run(engine.encode_prompt(data["prompt"]), data)
    except ApiError as e:
      return _error(e)
    return JSONResponse({"id": f"cmpl-{r.id}", "object": "text_completion",
                         "created": int(time.time()), "model": model_id,
                         "choices": [{"index": 0, "text": tok.decode(r.tokens),
                                      "finish_reason": r.finish_reason, "logprobs": None}],
                         "usage": usage(r)})

  async def chat(req: HttpRequest):
    try:
      data = await body(req, COMMON | {"messages"})
      msgs = data.get("messages")
      if not isinstance(msgs, list) or not msgs or not all(
          isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
      ids = tok.encode(tok.apply_chat_template(msgs))
      r = await run(ids, data)
    except ApiError as e:
      return _error(e)
    return JSONResponse({"id": f"chatcmpl-{r.id}", "object": "chat.completion",
                         "created": int(time.time()), "model": model_id,
                         "choices": [{"index": 0, "finish_reason": r.finish_reason,
                                      "message": {"role": "assistant",
                                                  "content": tok.decode(r.tokens)}}],
                         "usage": usage(r)})

  async def models(_):
    return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model",
                                                     "owned_by": "jaxvt", "created": 0}]})

  async def health(_):
    return JSONResponse({"status": "ok"})

  return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                           Route("/v1/completions", completions, methods=["POST"]),
                           Route("/v1/chat/completions", chat, methods=["POST"])])
