"""jaxvt.exports: programs kept as jax.export's serialized form, found again without tracing."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import exports, programs
from jaxvt.qweight import QMeta, QWeight

pytestmark = pytest.mark.skipif(not exports.serialization_available(),
                                reason="jax.export's serialization needs flatbuffers")


@dataclasses.dataclass(frozen=True)
class Ex:
  """Stands for layers.Exec: a static argument whose `deterministic` picks compiler options."""
  scale: float = 2.0
  deterministic: bool = True


traced = []


def f(w, x, y, *, ex):
  traced.append(ex)  # runs only while JAX traces f
  rows = w.data.astype(jnp.float32).sum(axis=1)
  return {"out": rows[w.fmts[0]] * ex.scale + x * y, "x": x + 1}


def weight(rows: int = 3) -> QWeight:
  meta = QMeta(rows=rows, cols=4, experts=0, formats=(8,), n_layers=2, host_layers=(1,))
  return QWeight(jnp.arange(rows * 4, dtype=jnp.uint8).reshape(rows, 4),
                 jnp.zeros((2, 2), jnp.uint32), jnp.asarray([1, 2], jnp.int32), meta)


@pytest.fixture
def store(tmp_path, monkeypatch):
  s = exports.open_store(str(tmp_path / "exported" / programs.extension_identity()))
  assert s is not None
  monkeypatch.setattr(programs, "export_store", lambda: s)
  traced.clear()
  return s


def program():
  return programs.Program(f, static_argnames=("ex",), donate_argnames=("x",))


def args():
  return weight(), jnp.arange(4.0), jnp.full((4,), 3.0)


def plain(*a, ex):
  return jax.jit(f, static_argnames=("ex",))(*a, ex=ex)


def test_a_second_program_loads_from_the_store_without_tracing(store):
  want = plain(*args(), ex=Ex())
  got = program()(*args(), ex=Ex())
  assert store.written == 1 and store.loaded == 0
  n = len(traced)
  again = program()(*args(), ex=Ex())  # a fresh Program: a later run's
  assert store.loaded == 1 and len(traced) == n  # not traced again
  for out in (got, again):
    np.testing.assert_array_equal(np.asarray(out["out"]), np.asarray(want["out"]))
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(want["x"]))
  files = [n for n in os.listdir(store.root) if n.endswith(exports.SUFFIX)]
  assert len(files) == 1


def test_what_decides_the_program_is_in_the_key(store, monkeypatch):
  p = program()
  p(*args(), ex=Ex())
  p(*args(), ex=Ex(scale=3.0))  # another static argument
  _, x, y = args()
  p(weight(rows=5), x, y, ex=Ex())  # another weight shape (and QMeta)
  w, x, y = args()
  p(w, x.astype(jnp.bfloat16), y, ex=Ex())  # another dtype
  p(*args(), ex=Ex(deterministic=False))  # other compiler options
  assert store.written == 5 and store.loaded == 0
  monkeypatch.setattr(exports, "source_digest", lambda: "another-jaxvt")
  program()(*args(), ex=Ex())  # other jaxvt source: not the stored program
  assert store.written == 6 and store.loaded == 0
  out = program()(*args(), ex=Ex(scale=3.0))
  assert store.loaded == 0 and store.written == 7  # still the other source
  np.testing.assert_array_equal(np.asarray(out["out"]),
                                np.asarray(plain(*args(), ex=Ex(scale=3.0))["out"]))


def test_a_damaged_file_is_replaced(store):
  program()(*args(), ex=Ex())
  (path,) = [os.path.join(store.root, n) for n in os.listdir(store.root)]
  with open(path, "r+b") as fh:
    fh.truncate(100)
  out = program()(*args(), ex=Ex())
  assert store.loaded == 0 and store.written == 2
  np.testing.assert_array_equal(np.asarray(out["out"]), np.asarray(plain(*args(), ex=Ex())["out"]))
  program()(*args(), ex=Ex())
  assert store.loaded == 1


def test_donation_and_compile_follow_the_jit(store):
  p = program()
  c = p.compile(*args(), ex=Ex())
  assert c.out_info["out"].shape == (4,)
  w, x, y = args()
  p(w, x, y, ex=Ex())
  assert x.is_deleted() and not y.is_deleted()  # x donated, as donate_argnames says
  specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding,
                                                      weak_type=a.weak_type), args())
  assert program().compile(*specs, ex=Ex()) is not None and store.loaded == 1  # from shapes


def test_under_a_transformation_or_without_a_store_it_is_the_jit(store, monkeypatch):
  p = programs.Program(f, static_argnames=("ex",))
  w, x, _ = args()
  ys = jnp.stack([jnp.full((4,), 3.0), jnp.full((4,), 5.0)])
  out = jax.vmap(lambda y: p(w, x, y, ex=Ex())["out"])(ys)
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(out[i]),
                                  np.asarray(plain(w, x, ys[i], ex=Ex())["out"]))
  assert store.written == 0  # tracers: the plain jit
  monkeypatch.setattr(programs, "export_store", lambda: None)
  program()(*args(), ex=Ex())
  assert store.written == 0


def test_an_address_in_a_static_argument_keeps_it_out_of_the_store(store):
  class Opaque:  # hashable, repr with its address: would not hold in another process
    deterministic = True
    scale = 2.0

  out = program()(*args(), ex=Opaque())
  assert store.written == 0 and not os.listdir(store.root)
  assert out["x"].shape == (4,)


def test_an_offloaded_model_gives_the_same_bits_through_the_store(tmp_path, monkeypatch):
  """A qwen35moe file with every offloadable weight in the host tier: prefill's logits and the
  greedy tokens through the store (exported, kept, read back) equal the plain jit's, bit for
  bit, and the model's programs were stored."""
  import jaxvt
  from jaxvt import ffi, synth
  if not ffi.available("cpu"):
    pytest.skip("needs the jaxvt extension")
  path = str(tmp_path / "moe.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe"), "q4_k_m", seed=2)
  s = exports.open_store(str(tmp_path / "exported"))
  with jaxvt.load(path, offload_gb=1.0, max_context=64) as eng:
    assert eng.plan.host_bytes > 0
    ids = [5, 17, 3, 99, 42, 7]
    runs = []
    for store in (None, s, s):  # the plain jit; through the store (written); (in memory)
      monkeypatch.setattr(programs, "export_store", lambda store=store: store)
      logits, _ = eng.prefill(ids)
      runs.append((np.asarray(logits), eng.generate(ids, max_tokens=6).tokens))
    assert s.written >= 2
    for logits, tokens in runs[1:]:
      np.testing.assert_array_equal(logits, runs[0][0])
      assert tokens == runs[0][1]


def test_the_store_opens_beside_the_cache_and_the_environment_turns_it_off():
  """use_compile_cache opens the store beside XLA's cache (keyed by the extension's build);
  store=False (JAXVT_EXPORT_STORE=0 at jaxvt.load) closes it for the process. The session's
  cache root (conftest), as every jaxvt.load of the suite uses it."""
  root = programs.cache_root(None)
  saved = programs._store[0]  # pylint: disable=protected-access
  try:
    programs.use_compile_cache(root, store=False)
    assert programs.export_store() is None
    programs.use_compile_cache(root)
    s = programs.export_store()
    assert s is not None and s.root.endswith(programs.extension_identity())
    assert os.path.isdir(s.root)
  finally:
    programs._store[0] = saved  # pylint: disable=protected-access


def test_the_memory_check_is_kept_under_the_programs_key(tmp_path, monkeypatch):
  """xla_workspace_bytes (load's XLA memory check) compiles the largest prefill once: a second
  check of the same program reads the figure the store kept (no lowering), a different program
  (another context) compiles again, and a damaged record is compiled again, not an error;
  without a store it always compiles. Every answer equals the compiled program's analysis."""
  import jaxvt
  from jaxvt import ffi, model_fns, synth
  if not ffi.available("cpu"):
    pytest.skip("needs the jaxvt extension")
  path = str(tmp_path / "moe.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe"), "q4_k_m", seed=2)
  s = exports.open_store(str(tmp_path / "exported"))
  lowered = []
  real_lower = model_fns.prefill_fn.lower

  def counting_lower(*a, **k):
    lowered.append(1)
    return real_lower(*a, **k)

  monkeypatch.setattr(model_fns.prefill_fn, "lower", counting_lower)
  with jaxvt.load(path, offload_gb=1.0, max_context=64) as eng:
    lowered.clear()  # the load's own check
    monkeypatch.setattr(programs, "export_store", lambda: None)
    want = model_fns.xla_workspace_bytes(eng)  # no store: compiled
    assert want is not None and want > 0 and len(lowered) == 1
    monkeypatch.setattr(programs, "export_store", lambda: s)
    assert model_fns.xla_workspace_bytes(eng) == want and len(lowered) == 2  # kept
    assert model_fns.xla_workspace_bytes(eng) == want and len(lowered) == 2  # read back
    records = [f for f in os.listdir(s.root) if f.endswith(f".{model_fns.MEMORY_KIND}.json")]
    assert len(records) == 1
    with open(os.path.join(s.root, records[0]), "w") as f:
      f.write("{cut")
    assert model_fns.xla_workspace_bytes(eng) == want and len(lowered) == 3  # damaged: compiled
    assert model_fns.xla_workspace_bytes(eng) == want and len(lowered) == 3
  n = len(lowered)
  with jaxvt.load(path, offload_gb=1.0, max_context=128) as other:
    assert len(lowered) == n + 1  # the load's check of another program: not the kept figure
    assert model_fns.xla_workspace_bytes(other) > want and len(lowered) == n + 1
