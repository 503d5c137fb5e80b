"""Tool calls without a model: Hermes calls read from whole answers and from answers fed in
arbitrary pieces (the same calls and content either way), what is not a call left as content,
the rendering of tools and earlier calls through a template that takes tools and through one
that does not, and the grammar of a forced call walked with random logits over the default
model's vocabulary (every walk parses as a call whose arguments validate)."""

import json

import jsonschema
import numpy as np
import pytest

from jaxvt import synth
from jaxvt.gguf.chat_template import render
from jaxvt.gguf.default_model import default_model_path
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.serve import structured, tools

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
NAMES = frozenset({"get_weather", "add"})


def _call(name, args):
  return f'{tools.OPEN}\n{json.dumps({"name": name, "arguments": args})}\n{tools.CLOSE}'


ANSWER = ("Let me check. " + _call("get_weather", {"city": "Paris", "days": 2}) + "\n"
          + _call("add", {"a": 1, "b": 2}) + " <tool_call>not json</tool_call> "
          + _call("rm", {"path": "/"}) + " done <tool")


def _plain(calls):
  return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_read_whole_answer():
  content, calls = tools.read(ANSWER, NAMES)
  assert _plain(calls) == [("get_weather", {"city": "Paris", "days": 2}),
                           ("add", {"a": 1, "b": 2})]
  assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
  assert len({c["id"] for c in calls}) == 2
  # not JSON, or a function not offered: content, as written
  assert "<tool_call>not json</tool_call>" in content and '"name": "rm"' in content
  assert content.startswith("Let me check.") and content.endswith("done <tool")
  assert _plain(tools.read(ANSWER, NAMES, parallel=False)[1]) == _plain(calls)[:1]
  assert tools.read("no calls here", NAMES) == ("no calls here", [])
  assert tools.read(_call("add", {"a": 1, "b": 2}), NAMES)[0] is None


@pytest.mark.parametrize("seed", range(4))
def test_pieces_give_the_whole_answers_reading(seed):
  rng = np.random.default_rng(seed)
  cuts = sorted(rng.choice(len(ANSWER), 25, replace=False))
  r = tools.Reader(NAMES)
  events = []
  for a, b in zip([0] + list(cuts), list(cuts) + [len(ANSWER)]):
    events += r.feed(ANSWER[a:b])
  events += r.close()
  content, calls = tools.read(ANSWER, NAMES)
  assert "".join(x for k, x in events if k == "content").strip() == content
  assert _plain([x for k, x in events if k == "call"]) == _plain(calls)
  # nothing that may start a marker is let out early
  r = tools.Reader(NAMES)
  assert r.feed("hi <tool_") == [("content", "hi ")]
  assert r.feed("x") == [("content", "<tool_x")]


def test_unclosed_call_at_the_end_is_read():
  text = f'{tools.OPEN}\n{json.dumps({"name": "add", "arguments": {"a": 3, "b": 4}})}\n'
  assert _plain(tools.read(text, NAMES)[1]) == [("add", {"a": 3, "b": 4})]


CONVERSATION = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.mark.parametrize("template", [synth.TOOLS_CHAT_TEMPLATE, synth.CHAT_TEMPLATE])
def test_tools_and_calls_render(template):
  p = tools.plan(CONVERSATION, TOOLS, "auto", True, template)
  text = render(template, {"messages": p.messages, "add_generation_prompt": True,
                           **p.template_kwargs}, "test")
  for t in TOOLS:  # every tool's definition, as JSON the prompt holds
    assert json.dumps(t["function"]["parameters"]) in text
  assert '"arguments": {"city": "Rome", "days": 1}' in text and "sunny" in text
  assert p.parse and p.grammar is None and p.names == NAMES
  assert (p.template_kwargs == {"tools": TOOLS}) == (template == synth.TOOLS_CHAT_TEMPLATE)


def test_choices():
  t = synth.TOOLS_CHAT_TEMPLATE
  assert not tools.plan(CONVERSATION, TOOLS, "none", True, t).parse
  assert tools.plan(CONVERSATION, TOOLS, "required", True, t).grammar == tools.call_grammar(TOOLS)
  named = {"type": "function", "function": {"name": "add"}}
  assert tools.plan(CONVERSATION, TOOLS, named, True, t).grammar == tools.call_grammar(TOOLS[1:])
  other = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}[TOOL_CALLS]"
  with pytest.raises(tools.ToolsError, match="does not read"):
    tools.plan(CONVERSATION, TOOLS, "auto", True, other)


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.from_gguf(default_model_path())


@pytest.mark.parametrize("which", [[0, 1], [1]])
def test_forced_call_walks_validate(tok, which):
  offered = [TOOLS[i] for i in which]
  c = None
  for seed in range(3):
    c = structured.Constraint(tok, tools.call_grammar(offered))
    rng = np.random.default_rng(seed)
    ids = []
    while not c.finished and len(ids) < 200:
      allowed = np.unpackbits(c.mask().view(np.uint8), bitorder="little")[:tok.vocab_size]
      t = int(np.argmax(np.where(allowed, rng.standard_normal(tok.vocab_size), -np.inf)))
      ids.append(t)
      assert c.advance(t)
    content, calls = tools.read(tok.decode(ids), frozenset(t["function"]["name"]
                                                           for t in offered))
    assert content is None and len(calls) == 1
    name, args = _plain(calls)[0]
    jsonschema.validate(args, {"get_weather": WEATHER, "add": ADD}[name])
