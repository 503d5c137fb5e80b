"""The device mesh: `--mesh tp=N,ep=M` over the local devices (and other hosts' when configured).

Two named axes, "ep" (major) and "tp" (minor), the mesh `ep x tp` over the first ep * tp devices
of `jax.devices()`:

  tp  tensor parallelism: attention heads (and the KV cache), dense-FFN and shared-expert
      columns, Gated-DeltaNet heads (and their conv / recurrent state), the output head's vocab
      rows split over "tp"; these are replicated over "ep".
  ep  expert parallelism: routed experts split over ("ep", "tp") together, so every device of
      the mesh holds its own 1/(ep*tp) of each layer's experts.

So `tp=4` shards everything four ways (experts included), `ep=4` shards only the experts and
replicates the rest, and `ep=2,tp=2` is in between. Several processes (jaxvt.parallel.processes
joins them): `jax.devices()` lists every process's devices, the mesh takes them in that order
(process 0's first), and each process places the shards of its own devices.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from jaxvt.errors import JaxvtError
from jaxvt.model import sharding
from jaxvt.model.axes import AXES, EP, TP
from jaxvt.model.config import ModelConfig
from jaxvt.model.sharding import Par


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Sizes of the mesh axes (1 = not split)."""
  tp: int = 1
  ep: int = 1

  @property
  def size(self) -> int:
    return self.tp * self.ep

  def __str__(self) -> str:
    return ",".join(f"{a}={getattr(self, a)}" for a in (TP, EP) if getattr(self, a) > 1) or "1"


def parse(text: str | None) -> MeshSpec | None:
  """'tp=2', 'ep=4', 'tp=2,ep=2' (commas or spaces) -> MeshSpec; '', '1' or None -> None."""
  if text is None or text.strip() in ("", "1"):
    return None
  sizes = {}
  for part in re.split(r"[,\s]+", text.strip()):
    m = re.fullmatch(r"(tp|ep)=(\d+)", part)
    if not m:
      raise JaxvtError(f"--mesh {text!r}: '{part}' is not AXIS=N with AXIS tp or ep; write e.g. "
                       "--mesh tp=2 or --mesh tp=2,ep=2")
    if m.group(1) in sizes:
      raise JaxvtError(f"--mesh {text!r} names '{m.group(1)}' twice; give each axis once")
    n = int(m.group(2))
    if n < 1:
      raise JaxvtError(f"--mesh {text!r}: {m.group(1)} must be at least 1")
    sizes[m.group(1)] = n
  spec = MeshSpec(**sizes)
  return None if spec.size == 1 else spec


def build(spec: MeshSpec, devices=None) -> jax.sharding.Mesh:
  """The `ep x tp` mesh over the first spec.size of `devices` (default: jax.devices())."""
  devices = list(jax.devices() if devices is None else devices)
  if spec.size > len(devices):
    raise JaxvtError(f"--mesh {spec} needs {spec.size} devices but JAX sees {len(devices)} "
                     f"({devices[0].platform}); use a smaller mesh")
  grid = np.empty((spec.ep, spec.tp), dtype=object)
  for i, d in enumerate(devices[:spec.size]):
    grid[i // spec.tp, i % spec.tp] = d
  return jax.sharding.Mesh(grid, AXES)


def layout(cfg: ModelConfig, spec: MeshSpec | None = None, device=None) -> Par:
  """Where a model runs: the mesh of `spec` over the first local devices, or (no spec) the
  1 x 1 mesh on `device` (default: JAX's first). JaxvtError when the model does not split over
  the mesh."""
  if spec is None:
    return sharding.one_device(device)
  if device is not None:
    raise JaxvtError("--mesh runs on the mesh's devices; drop the explicit device")
  sharding.check(cfg, spec)
  return Par(build(spec), head_sharded=sharding.head_sharded(cfg, spec))

