"""--interactive: each turn of a conversation gets the greedy tokens a fresh run of the whole
rendered conversation gets, while prefilling only what the earlier turns did not (the default
model, and a hybrid Gated-DeltaNet file); and the CLI reads its turns from stdin.

A prefill from a reused prefix runs other program shapes than a full one, so its logits agree to
rounding, not bit for bit (tests/test_prefix.py): the tokens must agree up to a step where the
fresh run's two best logits are within TIE of each other, where rounding may pick either."""

import os
import subprocess
import sys

import pytest

from jaxvt import run
from jaxvt.sampling import SamplingParams
from test_serve_fixtures import agree_up_to_a_tie, hybrid, smol  # noqa: F401  (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINES = ["What is 2+2?", "And 3+3?", "Thanks!"]
TIE = 1e-3


@pytest.fixture(params=["smol", "hybrid"])
def eng(request):
  return request.getfixturevalue(request.param)


def test_turns_equal_fresh_generations_and_reuse_the_earlier_ones(eng):
  outs = list(run.turns(eng, LINES, max_tokens=12, sampling=SamplingParams()))
  assert len(outs) == len(LINES) and outs[0].stats.cached_tokens == 0
  messages = []
  for line, out in zip(LINES, outs):
    messages.append({"role": "user", "content": line})
    ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(messages))
    agree_up_to_a_tie(eng, ids, out.tokens, TIE)
    messages.append({"role": "assistant", "content": out.text})
  # each later turn starts with the previous prompt at least
  for before, out in zip(outs, outs[1:]):
    assert out.stats.cached_tokens >= before.stats.prompt_tokens


def test_an_empty_line_ends_the_conversation(eng):
  outs = list(run.turns(eng, ["Hi", "", "never"], max_tokens=2,
                                sampling=SamplingParams()))
  assert len(outs) == 1


def test_cli_reads_turns_from_stdin():
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  p = subprocess.run([sys.executable, "-m", "jaxvt.run", "--interactive", "--max-tokens=6"],
                     input="What is 2+2?\nAnd 3+3?\n", capture_output=True, text=True, cwd=ROOT,
                     env=env, timeout=600)
  assert p.returncode == 0, p.stderr
  figures = [l for l in p.stderr.splitlines() if "prompt tokens reused" in l]
  assert len(figures) == 2 and figures[0].startswith("jaxvt: 0 of")
  assert not figures[1].startswith("jaxvt: 0 of")
  assert len([l for l in p.stdout.splitlines() if l.strip()]) >= 2
