"""How jaxvt compiles its programs: chosen numerics, and a compilation cache that persists.

Deterministic numerics. XLA:GPU picks among GEMM algorithms by timing them while it compiles
(autotuning); two processes, or two programs that differ only in where their weights live, can
pick differently and sum in a different order, and greedy tokens then split at a near-tie. So
jaxvt's programs compile with `DETERMINISTIC_OPTIONS`: autotuning off (XLA's default algorithm
for each GEMM, chosen from its shapes alone) and XLA's deterministic implementations of the ops
that have nondeterministic ones (scatter, ...). They are per-program compiler options
(`jax.jit(compiler_options=...)`), not XLA_FLAGS, so they hold in a notebook where JAX started
before jaxvt. They name XLA:GPU options, which the CPU compiler accepts and ignores.
`Exec.deterministic=False` (`jaxvt.load(deterministic=False)`, `--nodeterministic`,
JAXVT_DETERMINISTIC=0) compiles with XLA's defaults instead.

The compilation cache. `use_compile_cache` points JAX's persistent compilation cache at a
directory under the user's cache directory, so a second run loads its programs instead of
compiling them. JAX's cache key already covers what decides a program: the lowered computation
(every shape, dtype and layout of the weights and cache, which differ with the model and with
what the budget put in the host tier; the jaxvt custom calls' names and attributes), the
compile options (these numerics options among them), XLA_FLAGS, the jaxlib version and the
backend's platform version, and the devices. It does not cover the code behind a custom call:
XLA finds jaxvt's handlers by name when it loads a program, and what it decided while compiling
(a GPU handler's traits, such as whether it may be captured in a graph) came from the extension
that was loaded then. So the directory is keyed by the extension's build (`extension_identity`):
a rebuilt extension starts a cache of its own.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from typing import Callable, Mapping

import jax
from jax import export

from jaxvt import cachedir, exports, ffi

DETERMINISTIC_OPTIONS: dict[str, object] = {
    "xla_gpu_autotune_level": 0,
    "xla_gpu_exclude_nondeterministic_ops": True,
}
OFF_VALUES = ("0", "false", "no", "off")


# XLA:GPU's command buffers (CUDA graphs) run independent commands side by side instead of in
# the program's order: a custom call that touches none of a kernel's buffers (the inline expert
# fetch, jaxvt.ffi.prefetch) runs beside it. The same kernels, so the same bits.
CONCURRENT_OPTIONS: dict[str, object] = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def compiler_options(deterministic: bool, concurrent: bool = False) -> dict[str, object] | None:
  """The XLA compiler options of a jaxvt program (None: XLA's defaults)."""
  opts = {**(DETERMINISTIC_OPTIONS if deterministic else {}),
          **(CONCURRENT_OPTIONS if concurrent else {})}
  return opts or None


class Program:
  """A jitted jaxvt program whose compiler options follow its static `ex` argument
  (`ex.deterministic`, `ex.concurrent`): jax.jit's call, `lower`, `trace` and `eval_shape`, one
  jitted function per setting; and `compile`, which with the export store on
  (use_compile_cache) takes the program from the store instead of tracing it (jaxvt.exports).
  Static arguments go by keyword, the others by position."""

  def __init__(self, fun: Callable, concurrent: bool = True, **jit_kwargs):
    functools.update_wrapper(self, fun)
    self._fun, self._jit_kwargs = fun, jit_kwargs
    self._concurrent = concurrent  # False: XLA's default scheduling whatever `ex` asks
    self._jits = {m: jax.jit(fun, compiler_options=compiler_options(*m), **jit_kwargs)
                  for m in ((True, False), (False, False), (True, True), (False, True))}
    self._compiled: dict = {}  # in-memory key -> jax.stages.Compiled (the store's path)

  def _mode(self, kwargs: Mapping[str, object]) -> tuple[bool, bool]:
    """(deterministic, concurrent) of a call's `ex`."""
    ex = kwargs.get("ex")
    return (bool(getattr(ex, "deterministic", True)),
            self._concurrent and bool(getattr(ex, "concurrent", False)))

  def _pick(self, kwargs: Mapping[str, object]):
    return self._jits[self._mode(kwargs)]

  def _key(self, args, kwargs):
    """(in-memory key, leaves' keys, treedef) of a call, or None where it cannot be stored (a
    tracer or a number among the arguments, a mesh of several devices, unhashable statics)."""
    ex = kwargs.get("ex")
    if getattr(getattr(ex, "par", None), "size", 1) > 1:
      return None
    leaves, treedef = jax.tree_util.tree_flatten(args)
    keys = []
    for x in leaves:
      k = exports.leaf_key(x)
      if k is None:
        return None
      keys.append(k)
    try:
      key = (self._mode(kwargs), tuple(sorted(kwargs.items())), treedef, tuple(keys))
      hash(key)
    except TypeError:
      return None
    return key, keys, treedef

  def compile(self, *args, **kwargs) -> jax.stages.Compiled:
    """The compiled program for these arguments (arrays or jax.ShapeDtypeStructs): from the
    export store where it has it (no tracing), else traced, lowered, kept in the store and
    compiled (XLA's persistent cache may still hold the executable); without a store
    `lower(...).compile()`."""
    store = export_store()
    k = self._key(args, kwargs) if store is not None else None
    if k is None:
      return self.lower(*args, **kwargs).compile()
    return self._compile(store, k, args, kwargs)

  def file_key(self, *args, **kwargs) -> str | None:
    """The export store's key of these arguments' program (what decides it before tracing:
    jaxvt.exports.file_key), or None without a store or where they cannot be keyed."""
    ex = kwargs.get("ex")
    if export_store() is None or getattr(getattr(ex, "par", None), "size", 1) > 1:
      return None
    leaves, treedef = jax.tree_util.tree_flatten(args)
    keys, dev = [], None
    for x in leaves:
      k = exports.leaf_key(x)
      if k is None and isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
        k = (tuple(x.shape), str(x.dtype), bool(x.weak_type), "unplaced")  # a shape alone
      elif k is not None and dev is None:
        dev = next(iter(x.sharding.device_set))
      if k is None:
        return None
      keys.append(k)
    if dev is None:
      return None
    return exports.file_key(self._fun, compiler_options(*self._mode(kwargs)), kwargs, treedef,
                            keys, dev)

  def _compile(self, store, k, args, kwargs) -> jax.stages.Compiled:
    key, leaf_keys, treedef = k
    got = self._compiled.get(key)
    if got is not None:
      return got
    d = self._mode(kwargs)
    dev = next(iter(jax.tree_util.tree_leaves(args)[0].sharding.device_set))  # their platform's
    fkey = exports.file_key(self._fun, compiler_options(*d), kwargs, treedef, leaf_keys, dev)
    exp = store.get(fkey) if fkey is not None else None
    try:
      if exp is None:
        # arguments on the CPU while an accelerator is JAX's default: lowered for the CPU
        platforms = ["cpu"] if dev.platform == "cpu" else None  # None: the default backend's
        exp = export.export(self._jits[d], platforms=platforms,
                            disabled_checks=exports.disabled_checks(ffi_targets()))(*args, **kwargs)
        if fkey is not None:
          store.put(fkey, exp)
      donate = exports.donate_argnums(self._fun, self._jit_kwargs.get("donate_argnames", ()),
                                      len(args))
      call = lambda *a: exp.call(*a)
      call.__name__ = call.__qualname__ = self._fun.__name__  # XLA's name for it: jit_<name>
      got = jax.jit(call, donate_argnums=donate,
                    compiler_options=compiler_options(*d)).lower(*args).compile()
    except Exception:  # pylint: disable=broad-except  (not exportable: traced as before)
      got = self.lower(*args, **kwargs).compile()
    self._compiled[key] = got
    return got

  def __call__(self, *args, **kwargs):
    store = export_store()
    k = self._key(args, kwargs) if store is not None else None
    if k is None:
      return self._pick(kwargs)(*args, **kwargs)
    return self._compile(store, k, args, kwargs)(*args)

  def lower(self, *args, **kwargs):
    return self._pick(kwargs).lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    return self._pick(kwargs).trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return self._pick(kwargs).eval_shape(*args, **kwargs)


def jit(concurrent: bool = True, **jit_kwargs) -> Callable[[Callable], Program]:
  """`@programs.jit(static_argnames=..., donate_argnames=...)`: jax.jit for a function with a
  static `ex` (jaxvt.model.layers.Exec) argument; concurrent=False: never compiled under the
  concurrent scheduling, whatever `ex.concurrent` says."""
  return lambda fun: Program(fun, concurrent, **jit_kwargs)


def env_flag(env: Mapping[str, str], name: str, default: bool = True) -> bool:
  """An on/off environment variable: unset is `default`; 0/false/no/off are off."""
  value = env.get(name)
  if value is None or not value.strip():
    return default
  return value.strip().lower() not in OFF_VALUES


# ---- the persistent compilation cache -------------------------------------------------------

def default_cache_root(env: Mapping[str, str] = os.environ) -> str:
  """$XDG_CACHE_HOME/jaxvt, or ~/.cache/jaxvt (jaxvt.cachedir: without a home directory, one
  under the temporary directory)."""
  return cachedir.default_root(env)


def cache_root(setting: bool | str | None, env: Mapping[str, str] = os.environ) -> str | None:
  """The cache root for `setting` (None if off): a directory as given; True the default root;
  False off; None from JAXVT_COMPILE_CACHE (unset or empty: the default root; 0/false/no/off:
  off; anything else: that directory)."""
  if setting is None:
    value = (env.get("JAXVT_COMPILE_CACHE") or "").strip()
    setting = True if not value else False if value.lower() in OFF_VALUES else value
  if setting is True:
    return default_cache_root(env)
  if setting is False:
    return None
  return os.path.expanduser(setting)


@functools.cache
def ffi_targets() -> frozenset[str]:
  """Every custom-call target name of jaxvt's extension (any platform)."""
  return ffi.targets()


@functools.cache
def extension_identity() -> str:
  """16 hex digits of the SHA-256 of jaxvt's compiled extension, or "no-extension"."""
  ext = ffi.extension()
  path = getattr(ext, "__file__", None)
  if not path:
    return "no-extension"
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()[:16]


_cache_lock = threading.Lock()
_store: list = [None]  # the process's exports.ExportStore, set by use_compile_cache
_own: dict = {}  # an XLA cache directory jaxvt set -> its export store's directory


def export_store():
  """The export store use_compile_cache opened (jaxvt.exports), or None (the cache off)."""
  return _store[0]


def _open_store(xla_dir: str) -> None:
  """The store for XLA's cache directory `xla_dir`: `<root>/exported/<extension id>` where
  jaxvt set that cache up, else beside it (a cache of the user's); once per process."""
  if _store[0] is None:
    _store[0] = exports.open_store(
        _own.get(xla_dir) or os.path.join(xla_dir, "jaxvt-exported", extension_identity()))


def use_compile_cache(root: str | None, store: bool = True) -> str | None:
  """Turns JAX's persistent compilation cache on under `root` (None: leave it off); returns the
  directory in use, or None. A cache the user configured in JAX already (its directory set, or
  the cache disabled) is left as it is and returned as found. With `store` (JAXVT_EXPORT_STORE
  unset or on) jaxvt's export store opens beside the cache (jaxvt.exports); without, it closes."""
  with _cache_lock:
    if not store:
      _store[0] = None
    configured = jax.config.jax_compilation_cache_dir
    if configured or not jax.config.jax_enable_compilation_cache:
      if configured and store:
        _open_store(configured)
      return configured or None
    if root is None:
      return None
    path = os.path.join(root, "xla", extension_identity())
    try:
      os.makedirs(path, exist_ok=True)
    except OSError:  # an unwritable cache directory costs compile time, nothing else
      return None
    jax.config.update("jax_compilation_cache_dir", path)
    # jaxvt's programs compile in 0.1-10 s; JAX's default keeps only those above 1 s
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _own[path] = os.path.join(root, "exported", extension_identity())
    if store:
      _open_store(path)
    return path


class CompileCounter:
  """Counts JAX's compiles (each program XLA compiled, or loaded from the persistent cache) and
  persistent-cache hits, process-wide, from `jax.monitoring` events."""

  def __init__(self):
    self.compiles = 0
    self.cache_hits = 0
    self.seconds = 0.0
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)

  def _duration(self, event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      self.compiles += 1
      self.seconds += seconds

  def _event(self, event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
      self.cache_hits += 1

  def snapshot(self) -> tuple[int, int, float]:
    return self.compiles, self.cache_hits, self.seconds


class BackendStart:
  """On the H200 the first transfer to a GPU in a process takes 1.6-1.75 s (the backend's lazy
  start: a one-element device_put; the first program after it 0.13 s more), and the load's
  first program (the device arrays) paid it on the first token's path (1.6-2.7 s for a
  one-element program first). `with BackendStart(device):` puts a scalar on the
  device and runs a one-element program on a thread of its own, while the load opens the file,
  builds the tokenizer and plans (the start does not hold the GIL: 1.67 s for both where they
  took 2.74-2.93 s one after the other), and waits for it on the way out (nothing of JAX's is
  left running when a load fails). Not on the CPU (nothing to start). Its error is dropped:
  the load's own programs meet the same one."""

  SKIP = ("cpu",)  # platforms whose first program costs nothing worth a thread

  def __init__(self, device):
    self._thread = None
    if device.platform not in self.SKIP:
      self._thread = threading.Thread(target=self._start, args=(device,), name="jaxvt-backend",
                                      daemon=True)

  @classmethod
  def _start(cls, device) -> None:
    try:
      cls._run(device)
    except Exception:  # pylint: disable=broad-except  (the load's first program raises it)
      pass

  @staticmethod
  def _run(device) -> None:
    jax.jit(lambda x: x + 1)(jax.device_put(0, device)).block_until_ready()

  def __enter__(self) -> "BackendStart":
    if self._thread is not None:
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    if self._thread is not None:
      self._thread.join()


@functools.cache
def compile_counter() -> CompileCounter:
  """The process's CompileCounter (registered on first use)."""
  return CompileCounter()
