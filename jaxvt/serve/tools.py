"""Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` over a GGUF file's own
chat template, and the model's answer parsed back into `tool_calls`.

The tools go to the template as `tools=` (HF's apply_chat_template convention: a list of
{"type": "function", "function": {name, description, parameters}}), and earlier turns as the
template's authors expect them: an assistant message's `tool_calls` with `arguments` as an
object, `tool` messages as they came. The call format is recognised by the template's own
markers; the Hermes format (Qwen2.5, Qwen3, Hermes and the many templates that copied them) is
the one parsed:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that never mentions tools (the default model's) gets them the way llama-server does
for such templates: described in a system message that asks for that same format. A template
that takes tools but writes calls another way is refused (400) rather than misread.

tool_choice: "none" renders the tools and parses nothing (OpenAI: the model answers with a
message); "auto" parses whatever calls the model writes; "required" and a named function
constrain the answer (jaxvt.serve.structured) to one call of an offered function whose arguments
follow its `parameters` schema, so the call is valid even from a model that would not write one.
With parallel_tool_calls false at most one call is returned. Arguments are read with a JSON
parser, never with patterns over JSON.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Qwen2.5's own instructions, for templates without tool support.
_SYSTEM = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
           "You are provided with function signatures within <tools></tools> XML tags:\n"
           "<tools>\n{tools}\n</tools>\n\nFor each function call, return a json object with "
           "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
           '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


class ToolsError(ValueError):
  """Tools this model's template cannot carry (a 400)."""


@dataclasses.dataclass
class Plan:
  """How one chat request is rendered and read back."""
  messages: list[dict]
  template_kwargs: dict  # extra template variables (tools=)
  grammar: str | None  # the constraint of tool_choice required / named (a Lark grammar)
  parse: bool  # read tool calls out of the answer
  names: frozenset[str]  # the offered functions
  parallel: bool


def template_takes_tools(template: str | None) -> bool:
  return bool(template) and "tools" in template


def plan(messages: list[dict], tools: list[dict] | None, tool_choice: Any, parallel: bool,
         template: str | None) -> Plan:
  """The rendering of `messages` with `tools` (OpenAI dicts) under `template`, and what
  `tool_choice` asks of the answer."""
  takes = template_takes_tools(template)
  if takes and tools and OPEN not in template:
    raise ToolsError("tools: this model's chat template writes tool calls in a format jaxvt "
                     f"does not read (only the Hermes/Qwen {OPEN} format)")
  msgs = [_message(m, takes) for m in messages]
  if not tools:
    return Plan(msgs, {}, None, False, frozenset(), parallel)
  kwargs = {"tools": tools} if takes else {}
  if not takes:
    msgs = _with_system(msgs, "\n".join(json.dumps(t) for t in tools))
  names = frozenset(t["function"]["name"] for t in tools)
  choice = tool_choice if tool_choice is not None else "auto"
  grammar = None
  if choice == "required" or isinstance(choice, dict):
    chosen = [t for t in tools if choice == "required" or
              t["function"]["name"] == choice["function"]["name"]]
    grammar = call_grammar(chosen)
  return Plan(msgs, kwargs, grammar, choice != "none", names, parallel)


def call_grammar(tools: list[dict]) -> str:
  """A Lark grammar (llguidance's, with %json) of one Hermes call of one of `tools`."""
  schemas = [{"type": "object", "properties": {
      "name": {"const": t["function"]["name"]},
      "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
  schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
  options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
  schema = {**schema, "x-guidance": options}
  return (f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
          f"call: %json {json.dumps(schema)}\n")


def _message(m: dict, takes: bool) -> dict:
  """One message as the template gets it: content None as "", an assistant's tool calls'
  arguments as objects (or, for a template without tools, written into its content in the
  Hermes format)."""
  m = dict(m)
  if m.get("content") is None:
    m["content"] = ""
  calls = m.get("tool_calls")
  if calls:
    fns = [{**c.get("function", {}), "arguments": _loads(c.get("function", {}).get("arguments"))}
           for c in calls]
    if takes:
      m["tool_calls"] = [{**c, "function": f} for c, f in zip(calls, fns)]
    else:
      del m["tool_calls"]
      m["content"] = "\n".join([m["content"]] * bool(m["content"]) + [
          f"{OPEN}\n{json.dumps({'name': f.get('name'), 'arguments': f['arguments']})}\n{CLOSE}"
          for f in fns])
  if m.get("role") == "tool" and not takes:
    m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
  return m


def _loads(arguments: Any) -> Any:
  if isinstance(arguments, str):
    try:
      return json.loads(arguments)
    except ValueError:
      return arguments
  return arguments


def _with_system(msgs: list[dict], tools_json: str) -> list[dict]:
  text = _SYSTEM.format(tools=tools_json)
  if msgs and msgs[0].get("role") == "system":
    return [{**msgs[0], "content": f"{msgs[0]['content']}\n\n{text}"}] + msgs[1:]
  return [{"role": "system", "content": text}] + msgs


def _call(body: str, names: frozenset[str]) -> dict | None:
  """An OpenAI tool call from the JSON between a call's markers, or None if it is not one
  (not JSON, not {"name", "arguments"}, or a function not offered)."""
  try:
    obj, end = json.JSONDecoder().raw_decode(body.strip())
  except ValueError:
    return None
  if body.strip()[end:].strip() or not isinstance(obj, dict) or obj.get("name") not in names:
    return None
  args = obj.get("arguments", obj.get("parameters", {}))
  if isinstance(args, str):
    args = _loads(args)
  if not isinstance(args, dict):
    return None
  return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
          "function": {"name": obj["name"], "arguments": json.dumps(args)}}


class Reader:
  """Splits an answer, fed piece by piece, into content and tool calls: `feed(text)` and
  `close()` return events ("content", text) and ("call", call dict) as soon as they are
  certain. Text that may begin a call marker is held back until it is known."""

  def __init__(self, names: frozenset[str], parallel: bool = True):
    self.names, self.parallel = names, parallel
    self.calls: list[dict] = []
    self.content = ""
    self._buf = ""
    self._inside = False

  def feed(self, text: str) -> list[tuple[str, Any]]:
    self._buf += text
    out = []
    while True:
      if self._inside:
        end = self._buf.find(CLOSE)
        if end < 0:
          return out
        out += self._finish(self._buf[:end])
        self._buf = self._buf[end + len(CLOSE):]
        self._inside = False
        continue
      start = self._buf.find(OPEN)
      if start < 0:
        keep = _partial(self._buf, OPEN)
        out += self._text(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return out
      out += self._text(self._buf[:start])
      self._buf = self._buf[start + len(OPEN):]
      self._inside = True

  def close(self) -> list[tuple[str, Any]]:
    """The rest: an unclosed call is read as far as it goes (a model may end right after the
    JSON), anything else is content."""
    out = self._finish(self._buf) if self._inside else self._text(self._buf)
    self._buf, self._inside = "", False
    return out

  def _finish(self, body: str) -> list[tuple[str, Any]]:
    call = _call(body, self.names)
    if call is None:
      return self._text(f"{OPEN}{body}{CLOSE}")
    if self.calls and not self.parallel:
      return []
    self.calls.append(call)
    return [("call", call)]

  def _text(self, text: str) -> list[tuple[str, Any]]:
    if not text:
      return []
    self.content += text
    return [("content", text)]


def _partial(text: str, marker: str) -> int:
  """The length of the longest end of `text` that begins `marker`."""
  for k in range(min(len(marker) - 1, len(text)), 0, -1):
    if text.endswith(marker[:k]):
      return k
  return 0


def read(text: str, names: frozenset[str], parallel: bool = True) -> tuple[str | None, list]:
  """A whole answer as (content or None where only calls remain, tool calls)."""
  r = Reader(names, parallel)
  r.feed(text)
  r.close()
  content = r.content.strip() if r.calls else r.content
  return (content or None) if r.calls else content, r.calls


def argument_pieces(arguments: str, size: int = 16) -> list[str]:
  """A call's arguments string in the fragments a stream sends it as."""
  return [arguments[i:i + size] for i in range(0, len(arguments), size)] or [""]
