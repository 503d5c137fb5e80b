"""The prompt-reuse and engine-loop tests (test_prefix.py, test_serve_loop.py) on a GPU, with
the hybrid file's routed experts in the host tier (read in place by the kernels): reused logits
equal a full prefill's, batched greedy tokens equal solo ones, a next turn reuses the first.
Run on a GPU host with `pytest -m gpu tests/test_serve_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_prefix import *  # noqa: E402,F401,F403  (the same tests)
from test_serve_loop import *  # noqa: E402,F401,F403

from jaxvt import engine as engine_mod, synth  # noqa: E402
from test_serve_fixtures import hybrid_file  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):  # noqa: F811  (the routed experts in the host tier)
  e = engine_mod.load(hybrid_file(tmp_path_factory.mktemp("hybrid_gpu")), max_context=256,
                      offload_gb=1.0, offload_pattern=("exps",))
  assert e.plan.host_bytes > 0
  yield e
  e.close()


@pytest.fixture(scope="module")
def smol(tmp_path_factory):  # noqa: F811  (an attention-only file: the default model is a wheel)
  path = str(tmp_path_factory.mktemp("llama_gpu") / "llama.gguf")
  synth.write_model(path, synth.tiny_config("llama"), "q8_0", seed=14)
  e = engine_mod.load(path, max_context=256)
  yield e
  e.close()
