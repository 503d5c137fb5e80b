"""The server over several processes, its protocol in one process (jaxvt.serve.follow): an
engine loop on a LeaderSession whose messages are recorded (through JSON, as they travel), then
replayed by `follow` into a second BatchSession of the same engine. The follower must end with
the leader's cache bit for bit, its slot positions and its prefix cache's entries, having been
told nothing but the messages: concurrent requests, compaction, a sampled request with a logit
bias, a constrained request (its token masks) and a second turn that reuses the first (tests/test_serve_mesh.py runs the real thing over
two processes)."""

import json

import numpy as np

from jaxvt.serve import follow
from jaxvt.prefix import PrefixCache
from jaxvt.serve.batch import BatchSession
from jaxvt.serve import structured
from jaxvt.serve.loop import EngineLoop
from jaxvt.serve.scheduler import Request
from test_serve_fixtures import hybrid  # noqa: F401  (fixture)


class Recorder(follow.Channel):
  def __init__(self):
    self.sent = []

  def send(self, msg):
    self.sent.append(json.loads(json.dumps(msg, default=follow._plain)))


class Replay(follow.Channel):
  def __init__(self, msgs):
    self.msgs = list(msgs)

  def recv(self):
    return self.msgs.pop(0)


def _run(loop, reqs):
  events = [loop.submit(r) for r in reqs]
  assert all(ev.wait(300) for ev in events)
  return reqs


def test_a_follower_replaying_the_messages_holds_the_leaders_state(hybrid):
  eng = hybrid
  rng = np.random.default_rng(3)
  rec = Recorder()
  lead_prefix = PrefixCache(eng, budget_bytes=1 << 30, interval=16)
  session = follow.LeaderSession(eng, 3, lead_prefix, channel=rec)
  loop = EngineLoop(eng, 3, 8, lead_prefix, session=session)
  try:
    prompts = [rng.integers(5, eng.cfg.vocab_size, 7 + 4 * i).tolist() for i in range(4)]
    reqs = _run(loop, [Request(prompt=p, max_tokens=4 + 2 * (i % 2)) for i, p in enumerate(prompts)]
                + [Request(prompt=prompts[0], max_tokens=5, temperature=0.8, seed=9,
                           logit_bias={7: 3.0, 11: -2.0}, frequency_penalty=0.5,
                           presence_penalty=0.3),
                   Request(prompt=prompts[1], max_tokens=4, temperature=0.8, seed=5,
                           constraint=structured.Constraint(
                               eng.tokenizer, structured.json_grammar({"type": "object"})))])
    turn2 = reqs[0].fed + rng.integers(5, eng.cfg.vocab_size, 5).tolist()
    again = _run(loop, [Request(prompt=turn2, max_tokens=4)])[0]
  finally:
    assert loop.close()
    session.close()
  assert again.cached == len(reqs[0].fed)  # the second turn reused the first
  ops = [m[0] for m in rec.sent]
  assert {"prefill", "start", "decode", "finish", "move"} <= set(ops) and ops[-1] == "stop"
  decodes = [m for m in rec.sent if m[0] == "decode"]
  assert any(isinstance(p[5], dict) for m in decodes for _, _, p in m[1])  # the bias travelled
  assert any(m[4] for m in decodes)  # and the constrained request's token masks

  follower = BatchSession(eng, 3, PrefixCache(eng, budget_bytes=1 << 30, interval=16))
  follow.follow(follower, Replay(rec.sent))
  assert np.array_equal(follower.positions, session.positions)
  for k in session.cache:
    assert np.array_equal(np.asarray(follower.cache[k]), np.asarray(session.cache[k])), k
  assert session.counts is not None  # the penalized request's counts, kept alike
  assert np.array_equal(np.asarray(follower.counts), np.asarray(session.counts))
  lead_entries = [e.tokens for e in lead_prefix._entries.values()]
  assert [e.tokens for e in follower.prefix._entries.values()] == lead_entries


def test_row_parameters_survive_the_wire():
  feed = {0: (5, (0.0, 0, 1.0, 0, 3, None, 0.0, 0.0)),
          2: (np.int32(9), (np.float32(0.7), 40, 0.9, 123, 1, {4: 1.5, 300: -100.0}, 0.5, 0.2))}
  wire = json.loads(json.dumps(follow._feed_json(feed), default=follow._plain))
  back = follow._feed_of(wire)
  assert back == {0: (5, (0.0, 0, 1.0, 0, 3, None, 0.0, 0.0)),
                  2: (9, (np.float32(0.7).item(), 40, 0.9, 123, 1, {4: 1.5, 300: -100.0}, 0.5,
                          0.2))}
