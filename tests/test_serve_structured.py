"""Structured output and tool calls through the openai client against real server processes
(loopback): JSON schemas of several shapes on the default model, streamed and not, each answer
parsed and validated with jsonschema; a constrained and an unconstrained request together (the
unconstrained one's greedy answer equals its solo answer); tool calls on a tiny synthetic file
whose template takes tools (Hermes format) and on the default model (whose template does not),
tool_choice required / named / none / auto, streamed deltas reassembled against the
non-streamed answer, and a conversation holding earlier calls and their results."""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from jaxvt import synth
from test_serve_http import Server

GREEDY = {"temperature": 0}
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "bright": {"type": "boolean"}}, "required": ["color", "bright"],
             "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "fruits": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "minItems": 1, "maxItems": 4}},
              "required": ["fruits"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "location": {"type": "object", "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                         "required": ["lat", "lon"], "additionalProperties": False}},
                 "required": ["name", "location"], "additionalProperties": False}},
               "required": ["city"], "additionalProperties": False},
}
PROMPTS = {"person": "Give a famous scientist's name and age.",
           "enum": "Pick a color.", "array": "List some fruits.",
           "nested": "Describe Paris with its coordinates."}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather forecast of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two numbers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999},
            "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
  # Without prefix reuse: a repeated prompt is then computed as it was the first time (the
  # stream is compared with the non-streamed answer token for token).
  s = Server(tmp_path_factory.mktemp("smol"), "--max_context=512", "--max-batch=4",
             "--prefix-cache-gb=0")
  s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=300, max_retries=0)
  yield s
  assert s.stop() == 0, s.stderr()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny random-weight llama file whose chat template takes tools (Hermes format)."""
  tmp = tmp_path_factory.mktemp("tiny")
  path = tmp / "tools.gguf"
  synth.write_model(path, synth.tiny_config("llama", context_length=1024), "q8_0", seed=3,
                    chat_template=synth.TOOLS_CHAT_TEMPLATE)
  s = Server(tmp, f"--model={path}", "--max_context=1024", "--prefix-cache-gb=0",
             host="127.0.0.3")
  s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=300, max_retries=0)
  yield s
  assert s.stop() == 0, s.stderr()


def _fmt(name):
  return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                 "strict": True}}


def _stream(client, **kw):
  """A streamed chat answer reassembled: (content, tool calls, finish_reason)."""
  content, calls, reason = "", {}, None
  for ch in client.chat.completions.create(stream=True, **kw):
    d = ch.choices[0].delta
    content += d.content or ""
    for tc in d.tool_calls or []:
      c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
      if tc.id:
        assert c["id"] is None
        c["id"], c["name"] = tc.id, tc.function.name
      c["arguments"] += tc.function.arguments or ""
    reason = ch.choices[0].finish_reason or reason
  return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_answers_validate(smol, name):
  kw = dict(model="any", messages=[{"role": "user", "content": PROMPTS[name]}],
            response_format=_fmt(name), max_tokens=200, **GREEDY)
  r = smol.client.chat.completions.create(**kw)
  assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
  jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
  if name in ("person", "nested"):  # streamed: the same answer, chunk by chunk
    content, calls, reason = _stream(smol.client, **kw)
    assert (content, calls, reason) == (r.choices[0].message.content, [], "stop")


@pytest.mark.parametrize("name", ["person", "enum", "array"])
def test_schema_answers_validate_random_weights(tiny, name):
  """A random-weight model: the constraint alone makes the answer valid, greedy and sampled."""
  for kw in (GREEDY, {"temperature": 1.0, "seed": 7}):
    r = tiny.client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": PROMPTS[name]}],
        response_format=_fmt(name), max_tokens=400, **kw)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])


def test_json_object_mode_sampled(smol):
  for seed in range(2):
    r = smol.client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        response_format={"type": "json_object"}, max_tokens=300, temperature=0.8, seed=seed)
    if r.choices[0].finish_reason == "stop":
      assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an unfinished object is still a prefix of one: it never starts as something else
      assert r.choices[0].finish_reason == "length"
      assert r.choices[0].message.content.startswith("{")


def test_constrained_beside_unconstrained(smol):
  free = dict(model="any", messages=[{"role": "user", "content": "Write a haiku about rain."}],
              max_tokens=24, **GREEDY)
  solo = smol.client.chat.completions.create(**free).choices[0].message.content
  jobs = [dict(free)] + [dict(model="any", messages=[{"role": "user", "content": PROMPTS[n]}],
                              response_format=_fmt(n), max_tokens=200, **GREEDY)
                         for n in ("person", "enum", "array")]
  with ThreadPoolExecutor(len(jobs)) as pool:
    out = list(pool.map(lambda kw: smol.client.chat.completions.create(**kw), jobs))
  assert out[0].choices[0].message.content == solo
  for r, n in zip(out[1:], ("person", "enum", "array")):
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[n])


def test_bad_schema_is_a_400(smol):
  with pytest.raises(openai.BadRequestError, match="response_format"):
    smol.client.chat.completions.create(
        model="any", messages=ASK, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}}})


def _check_calls(calls, names):
  assert calls
  for c in calls:
    assert c.type == "function" and c.id and c.function.name in names
    jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


@pytest.mark.parametrize("which", ["tiny", "smol"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls(which, choice, request):
  """tool_choice required / a named function: a valid call even from random weights; the
  stream's deltas reassemble to the same call (the ids aside)."""
  s = request.getfixturevalue(which)
  tc = "required" if choice == "required" else {"type": "function",
                                                "function": {"name": "add"}}
  kw = dict(model="any", messages=ASK, tools=TOOLS, tool_choice=tc, max_tokens=120, **GREEDY)
  r = s.client.chat.completions.create(**kw)
  m = r.choices[0].message
  assert r.choices[0].finish_reason == "tool_calls" and m.content is None
  _check_calls(m.tool_calls, {"add"} if choice == "named" else set(PARAMS))
  assert len(m.tool_calls) == 1
  content, calls, reason = _stream(s.client, **kw)
  assert reason == "tool_calls" and content == ""
  assert [(c["name"], c["arguments"]) for c in calls] == [
      (c.function.name, c.function.arguments) for c in m.tool_calls]


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_auto_and_none_agree_streamed(which, request):
  """auto and none: whatever the model writes, the stream reassembles to the whole answer."""
  s = request.getfixturevalue(which)
  for tc in ("auto", "none"):
    kw = dict(model="any", messages=ASK, tools=TOOLS, tool_choice=tc, max_tokens=60, **GREEDY)
    r = s.client.chat.completions.create(**kw)
    m = r.choices[0].message
    content, calls, reason = _stream(s.client, **kw)
    assert reason == r.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in m.tool_calls or []]
    if tc == "none":
      assert not m.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    if m.tool_calls:
      _check_calls(m.tool_calls, set(PARAMS))
    assert (content or None) == (m.content or None) or m.tool_calls and content.strip() == (
        m.content or "")


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_conversation_with_calls_and_results(which, request):
  """An earlier call (arguments a JSON string, as OpenAI sends it) and its result render
  through the template; the prompt holds both."""
  s = request.getfixturevalue(which)
  first = s.client.chat.completions.create(model="any", messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=120, **GREEDY)
  call = first.choices[0].message.tool_calls[0]
  msgs = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
  r = s.client.chat.completions.create(model="any", messages=msgs, tools=TOOLS,
                                       max_tokens=8, **GREEDY)
  bare = s.client.chat.completions.create(model="any", messages=ASK, tools=TOOLS,
                                          max_tokens=8, **GREEDY)
  assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 10
