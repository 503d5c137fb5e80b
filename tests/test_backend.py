"""The backend interface (jaxvt.ffi.backend): both backends offer the same ops, the model picks
its kernels only through `Exec.backend`, and the ggml steps lower to the custom calls only on
KERNELS."""

from __future__ import annotations

import ast
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi
from jaxvt.ffi.backend import KERNELS, REFERENCE, Kernels, Reference
from jaxvt.model.layers import Exec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ops(cls) -> set[str]:
  return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}


def test_reference_and_kernels_offer_the_same_ops():
  assert _ops(Reference) == _ops(Kernels)
  assert {"matmul", "rms_norm", "rope", "attention", "swiglu", "fusion_barrier"} <= _ops(Kernels)
  assert Exec(kernels=True).backend is KERNELS and Exec().backend is REFERENCE


def _kernel_choices(path: str) -> list[str]:
  """Where the file at `path` picks kernels itself: reads `.kernels` (but Exec's own
  `self.kernels`, which its `backend` property reads), passes `kernels=`, or imports
  jaxvt.ffi.steps."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  out = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr == "kernels"
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
      out.append(f"line {node.lineno}: .kernels")
    elif isinstance(node, ast.keyword) and node.arg == "kernels":
      out.append(f"line {node.lineno}: kernels=")
    elif isinstance(node, ast.ImportFrom) and (
        node.module == "jaxvt.ffi.steps"
        or (node.module == "jaxvt.ffi" and any(a.name == "steps" for a in node.names))):
      out.append(f"line {node.lineno}: imports jaxvt.ffi.steps")
  return out


def test_the_model_computes_only_through_the_backend():
  d = os.path.join(ROOT, "jaxvt", "model")
  found = {f: c for f in sorted(os.listdir(d)) if f.endswith(".py")
           for c in [_kernel_choices(os.path.join(d, f))] if c}
  assert not found, found


@pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")
@pytest.mark.parametrize("op,target", [("rms_norm", "jaxvt_rms_norm"), ("rope", "jaxvt_rope"),
                                       ("attention", "jaxvt_attention"),
                                       ("swiglu", "jaxvt_swiglu")])
def test_the_ggml_steps_are_custom_calls_on_kernels_only(op, target):
  x = jnp.zeros((1, 2, 4, 8), jnp.float32)
  cache = jnp.zeros((2, 1, 16, 4, 8), jnp.float16)
  pos = jnp.zeros((1, 2), jnp.int32)
  args = {"rms_norm": lambda b: (x, None, 1e-5, None),
          "rope": lambda b: (x, pos, 8, 10000.0, True, None),
          "attention": lambda b: (x, cache, cache, jnp.int32(1), pos, jnp.full((1,), 2, jnp.int32),
                                  16, 0.125, None),
          "swiglu": lambda b: (x, x, None)}[op]
  lowered = {b: jax.jit(lambda: getattr(b, op)(*args(b))).lower().as_text()
             for b in (REFERENCE, KERNELS)}
  assert target in lowered[KERNELS] and target not in lowered[REFERENCE]


def test_fusion_barrier_keeps_the_value():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)), jnp.float32)
  for b in (REFERENCE, KERNELS):
    np.testing.assert_array_equal(np.asarray(jax.jit(b.fusion_barrier)(x)), np.asarray(x))
  assert "optimization_barrier" in jax.jit(KERNELS.fusion_barrier).lower(x).as_text()
  assert "optimization_barrier" not in jax.jit(REFERENCE.fusion_barrier).lower(x).as_text()
