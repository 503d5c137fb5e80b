"""The pure scheduler: admission order, the bounded queue, finishing on eos/stop/max_tokens."""

import random

import pytest

from jaxvt.serve import scheduler as sch


def _req(n=3, **kw):
  return sch.Request(prompt=[1, 2], max_tokens=n, **kw)


def test_fifo_admission_up_to_max_batch_and_queue_bound():
  s = sch.Scheduler(max_batch=2, max_queue=3)
  reqs = [_req() for _ in range(5)]  # two take the free slots at the next admission, three wait
  for r in reqs:
    s.submit(r)
  with pytest.raises(sch.QueueFull):
    s.submit(_req())
  assert s.admit() == reqs[:2]
  assert [r.slot for r in reqs[:2]] == [0, 1]
  assert list(s.queue) == reqs[2:]
  assert s.admit() == []  # no free slot
  with pytest.raises(sch.QueueFull):  # no slot free and three waiting already
    s.submit(_req())


def test_release_holds_back_what_a_stop_string_may_still_cut():
  s = sch.Scheduler(max_batch=1, max_queue=0)
  r = _req(9, stop=("STOP",))
  s.submit(r)
  s.admit()
  released = []
  for piece in ("ab", "cS", "T", "x", "ST", "OP", "zz"):
    if not r.done:
      s.step({0: (7, piece)})
      released.append(r.release())
  # "S" and "ST" may begin "STOP" (held back); "STx" cannot (released)
  assert released == ["ab", "c", "", "STx", "", ""] and r.text == "abcSTx"
  assert "".join(released) == r.text and r.finish_reason == "stop"


def test_fed_is_what_the_cache_holds():
  s = sch.Scheduler(max_batch=2, max_queue=0)
  a, b = _req(2), _req(9, eos_ids=frozenset({0}))
  s.submit(a)
  s.submit(b)
  s.admit()
  s.step({0: (5, "x"), 1: (6, "y")})
  s.step({0: (7, "x"), 1: (0, "")})
  assert a.fed == [1, 2, 5]  # the last token at max_tokens is never fed back
  assert b.fed == [1, 2, 6]  # everything before the eos was


def test_finish_reasons_and_slot_reuse():
  s = sch.Scheduler(max_batch=3, max_queue=8)
  a, b, c, d = _req(2), _req(9, eos_ids=frozenset({0})), _req(9, stop=("END",)), _req(1)
  for r in (a, b, c, d):
    s.submit(r)
  s.admit()
  assert s.step({0: (5, "x"), 1: (6, "y"), 2: (7, "aEN")}) == []
  done = s.step({0: (5, "x"), 1: (0, ""), 2: (8, "Dzz")})
  assert done == [a, b, c]
  assert (a.finish_reason, a.tokens) == ("length", [5, 5])
  assert (b.finish_reason, b.tokens) == ("stop", [6])  # eos not part of the output
  assert (c.finish_reason, c.text) == ("stop", "a")
  assert s.admit() == [d] and d.slot == 0
  assert s.step({0: (3, "q")}) == [d] and s.idle()


def test_cancel_from_queue_and_slot():
  s = sch.Scheduler(max_batch=1, max_queue=2)
  a, b = _req(), _req()
  s.submit(a)
  s.submit(b)
  s.admit()
  s.cancel(b)
  s.cancel(a)
  assert s.idle() and a.finish_reason == b.finish_reason == "cancelled"


def test_random_traffic_every_request_finishes_once_with_its_length():
  rng = random.Random(0)
  s = sch.Scheduler(max_batch=4, max_queue=100)
  want = {}
  for _ in range(30):
    r = _req(rng.randint(1, 6))
    want[r.id] = r.max_tokens
    s.submit(r)
  finished = []
  while not s.idle():
    s.admit()
    assert len(s.active()) <= 4
    finished += s.step({r.slot: (1, "t") for r in s.active()})
  assert sorted(r.id for r in finished) == sorted(want)
  assert all(len(r.tokens) == want[r.id] and r.finish_reason == "length" for r in finished)


def test_compact_keeps_the_active_requests_in_the_lowest_slots():
  s = sch.Scheduler(max_batch=4, max_queue=0)
  reqs = [_req(9) for _ in range(4)]
  for r in reqs:
    s.submit(r)
  s.admit()
  s.cancel(reqs[0])
  s.cancel(reqs[2])
  assert s.compact() == [(3, 0)]
  assert s.slots == [reqs[3], reqs[1], None, None] and reqs[3].slot == 0
  assert s.compact() == []
  new = _req()
  s.submit(new)
  assert s.admit() == [new] and new.slot == 2
