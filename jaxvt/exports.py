"""Programs kept as jax.export's serialized form, so a later run skips tracing and lowering.

JAX's persistent compilation cache (jaxvt.programs.use_compile_cache) skips XLA's compile, but
finds its entry by the lowered module: every run still traces the model's Python and lowers it
(seconds for a large model's first-token programs).
An `ExportStore` keeps each program jaxvt compiles also as `jax.export.Exported`, serialized,
under a key made of what decides the program before it is traced:

  * the function (module and name) and its static arguments (frozen dataclasses and numbers:
    their repr; one that shows an object's address is not cached);
  * every other argument's pytree structure (a QWeight's static QMeta with it), shape, dtype,
    weak type and sharding (devices, memory kind, the HLO sharding);
  * the compiler options (jaxvt.programs: deterministic or not), the platform and device kind,
    the versions of jax and jaxlib, and a digest of jaxvt's own Python source;
  * the extension's build: the store's directory is `<cache root>/exported/<extension id>`.

A hit deserializes the program (milliseconds) and lowers a call to it (tens of milliseconds);
XLA's cache then finds that lowered module's executable. A miss exports (the trace and lowering
it would have done anyway), writes the file atomically and goes on the same way, so a first
and a later run compile the same module. A file that cannot be read or deserialized is replaced;
a program that cannot be exported (a pytree type without a serialization, a custom call JAX
refuses) is compiled from its trace as before. jax.export's serialization needs the
`flatbuffers` package; without it there is no store (`open_store` returns None).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pathlib
import tempfile
import threading
from typing import Callable, Mapping, Sequence

import jax
import jaxlib
from jax import export

from jaxvt.qweight import CacheTables, QMeta, QWeight

SUFFIX = ".jaxexp"


def _qmeta_bytes(aux) -> bytes:
  return json.dumps([dataclasses.asdict(m) for m in aux]).encode()


def _qmeta_from(b: bytes):
  return tuple(QMeta(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
               for d in json.loads(b))


@functools.cache
def _register() -> None:
  """QWeight's and CacheTables' pytree nodes serializable (their aux data: the QMeta, the slot
  sizes); once per process."""
  export.register_pytree_node_serialization(QWeight, serialized_name="jaxvt.qweight.QWeight",
                                            serialize_auxdata=_qmeta_bytes,
                                            deserialize_auxdata=_qmeta_from)
  export.register_pytree_node_serialization(
      CacheTables, serialized_name="jaxvt.qweight.CacheTables",
      serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
      deserialize_auxdata=lambda b: tuple(json.loads(b)))


@functools.cache
def source_digest() -> str:
  """16 hex digits of the SHA-256 of jaxvt's Python source (every .py file of the package)."""
  root = pathlib.Path(__file__).resolve().parent
  h = hashlib.sha256()
  for p in sorted(root.rglob("*.py")):
    h.update(str(p.relative_to(root)).encode())
    h.update(p.read_bytes())
  return h.hexdigest()[:16]


def serialization_available() -> bool:
  try:
    import flatbuffers  # noqa: F401  (jax.export's serialization imports it)
  except ImportError:
    return False
  return True


@functools.lru_cache(maxsize=1024)
def _sharding_key(s, ndim: int) -> str:
  try:
    hlo = str(s._to_xla_hlo_sharding(ndim))  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except  (a sharding without one: its repr)
    hlo = repr(s)
  devices = sorted(d.id for d in s.device_set)
  return f"{devices}/{s.memory_kind}/{hlo}"


def leaf_key(x) -> tuple | None:
  """(shape, dtype, weak type, sharding) of an array or ShapeDtypeStruct; None for anything
  else (a Python number, a tracer: not cached)."""
  if isinstance(x, jax.core.Tracer) or not hasattr(x, "shape") or not hasattr(x, "dtype"):
    return None
  s = getattr(x, "sharding", None)
  if s is None:
    return None
  return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
          _sharding_key(s, len(x.shape)))


def file_key(fun: Callable, options: Mapping | None, static: Mapping, treedef,
             leaves: Sequence[tuple], dev) -> str | None:
  """The file name (hex digest) of a program whose arguments are on device `dev`'s platform, or
  None where a static argument's repr shows an object's address (the key would not hold in
  another process)."""
  statics = repr(sorted(static.items()))
  if " at 0x" in statics or " object at " in statics:
    return None
  parts = [f"{fun.__module__}.{fun.__qualname__}", repr(sorted((options or {}).items())), statics,
           str(treedef), repr(list(leaves)), dev.platform, getattr(dev, "device_kind", ""),
           jax.__version__, jaxlib.__version__, dev.client.platform_version, source_digest()]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@dataclasses.dataclass
class ExportStore:
  """Serialized exported programs under `root` (one file each); counts what it served."""
  root: str
  loaded: int = 0   # programs read from the store
  written: int = 0  # programs exported and written
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def path(self, key: str) -> str:
    return os.path.join(self.root, key + SUFFIX)

  def get(self, key: str) -> export.Exported | None:
    try:
      with open(self.path(key), "rb") as f:
        data = f.read()
      exp = export.deserialize(bytearray(data))
    except Exception:  # pylint: disable=broad-except  (absent, cut short, another format)
      return None
    with self._lock:
      self.loaded += 1
    return exp

  def put(self, key: str, exp: export.Exported) -> None:
    try:  # a pytree type without a serialization (a bench arm's weight type): not kept
      data = exp.serialize()
    except Exception:  # pylint: disable=broad-except
      return
    try:
      fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".part-")
      with os.fdopen(fd, "wb") as f:
        f.write(data)
      os.replace(tmp, self.path(key))
    except OSError:  # an unwritable store costs the next run its tracing, nothing else
      return
    with self._lock:
      self.written += 1


  def get_json(self, key: str, kind: str):
    """What put_json kept for `key` under `kind` (a small JSON value), or None: absent, cut short
    or not JSON."""
    try:
      with open(os.path.join(self.root, f"{key}.{kind}.json")) as f:
        return json.load(f)
    except (OSError, ValueError):
      return None

  def put_json(self, key: str, kind: str, value) -> None:
    """Keeps a small JSON value beside the program of `key` (written atomically; an unwritable
    store keeps nothing)."""
    try:
      fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".part-")
      with os.fdopen(fd, "w") as f:
        json.dump(value, f)
      os.replace(tmp, os.path.join(self.root, f"{key}.{kind}.json"))
    except OSError:
      return


def open_store(path: str) -> ExportStore | None:
  """The store in directory `path` (made if absent; the caller keys it by the extension's
  build), or None where it cannot be (no flatbuffers for jax.export's serialization, an
  unwritable directory)."""
  if not serialization_available():
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  _register()
  return ExportStore(path)


def disabled_checks(targets) -> list:
  """jax.export refuses custom calls without a compatibility guarantee; jaxvt's own (`targets`,
  every name its extension registers) are fine here: the store is keyed by the extension's
  build."""
  return [export.DisabledSafetyCheck.custom_call(n) for n in sorted(set(targets))]


def donate_argnums(fun: Callable, donate_argnames: Sequence[str], n_args: int) -> tuple[int, ...]:
  """Positions of `donate_argnames` among fun's first n_args positional parameters."""
  params = list(inspect.signature(fun).parameters)[:n_args]
  return tuple(i for i, p in enumerate(params) if p in set(donate_argnames))
