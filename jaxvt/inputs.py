"""Every number and text a user hands jaxvt, checked in one place for the CLI and the Python API.

The CLI calls these before JAX starts (so a bad flag is answered at once); `jaxvt.load`,
`Engine` and `SamplingParams` call the same functions, so the API refuses what the CLI refuses.
A value is refused with a one-line JaxvtError naming it, its allowed range and what was given;
nothing is silently clamped except where the result is the same run (a top-k at or above the
vocabulary keeps every token, exactly as top-k 0 does, so it becomes 0).

Numbers must be finite, in range, and whole where they count something (64.0 is 64; 64.5,
nan, inf, True and "64" are refused). Text must be valid UTF-8: a prompt holding bytes that are
not (a shell passes them to Python as lone surrogates, the API may get `bytes`) is refused, with
the offset of the first bad byte, rather than decoded into replacement characters the user never
typed.

This module imports nothing heavy (no JAX, no numpy).
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Iterable

from jaxvt.errors import JaxvtError, JaxvtWarning, escape

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_GIB = float(1 << 20)  # 1 PiB: beyond any host tier or device; bigger is a typo
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6  # float32 logits / t stay finite in this range

# How a parameter is spelled on the command line (the API uses the Python name).
FLAGS = {"max_tokens": "--max-tokens", "max_context": "--max-context", "temperature":
         "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
         "offload_gb": "--offload-gb", "device_gb": "--device-gb", "num_processes":
         "--num-processes", "process_id": "--process-id", "prompt": "--prompt",
         "expert_cache_gb": "--expert-cache-gb"}


def _label(name: str, cli: bool) -> str:
  return FLAGS.get(name, name) if cli else name


def _num(x: float) -> str:
  return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _show(value: Any) -> str:
  return escape(repr(value) if isinstance(value, str) else value, 60)


def number(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, cli: bool = False) -> float:
  """`value` as a finite float in [lo, hi] ((lo, hi] with lo_open); JaxvtError otherwise."""
  what = _label(name, cli)
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise JaxvtError(f"{what} must be a number (got {_show(value)})")
  x = float(value)
  if not math.isfinite(x):
    raise JaxvtError(f"{what} must be a finite number (got {_show(value)})")
  if (lo is not None and (x < lo or lo_open and x == lo)) or (hi is not None and x > hi):
    low = "" if lo is None else f"{'above' if lo_open else 'at least'} {_num(lo)}"
    high = "" if hi is None else f"at most {_num(hi)}"
    raise JaxvtError(f"{what} must be {' and '.join(s for s in (low, high) if s)} "
                     f"(got {_show(value)})")
  return x


def whole(name: str, value: Any, lo: int, hi: int, cli: bool = False) -> int:
  """`value` as an int in [lo, hi]: ints, numpy integers and integral finite floats."""
  what = _label(name, cli)
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise JaxvtError(f"{what} must be a whole number (got {_show(value)})")
  if not isinstance(value, numbers.Integral):
    x = float(value)
    if not math.isfinite(x) or not x.is_integer():
      raise JaxvtError(f"{what} must be a whole number (got {_show(value)})")
    value = int(x)
  n = int(value)
  if not lo <= n <= hi:
    raise JaxvtError(f"{what} must be between {lo} and {hi} (got {_show(value)})")
  return n


def max_tokens(value: Any, cli: bool = False) -> int:
  return whole("max_tokens", value, 1, INT32_MAX, cli)


def max_context(value: Any, cli: bool = False) -> int:
  """At least 1; the model's own limit is checked when the file is open."""
  return whole("max_context", value, 1, INT32_MAX, cli)


DEFAULT_CONTEXT = 2048


def context_for(value: int | None, trained: int) -> int:
  """The context to allocate for a model trained on `trained` tokens: `value` as given (load
  refuses one past `trained`), or with None DEFAULT_CONTEXT, or `trained` where that is shorter
  (a JaxvtWarning says so)."""
  if value is not None:
    return value
  if trained < DEFAULT_CONTEXT:
    warnings.warn(JaxvtWarning(
        f"the model's trained context is {trained} tokens, less than the default "
        f"--max-context {DEFAULT_CONTEXT}; using {trained}"), stacklevel=3)
    return trained
  return DEFAULT_CONTEXT


def seed(value: Any, cli: bool = False) -> int:
  """Any 64-bit signed integer (jax.random.key's range)."""
  return whole("seed", value, INT64_MIN, INT64_MAX, cli)


def sampling(temperature: Any, top_k: Any, top_p: Any, cli: bool = False
             ) -> tuple[float, int, float]:
  """(temperature, top_k, top_p) checked: temperature 0 (greedy) or in [MIN_TEMPERATURE,
  MAX_TEMPERATURE]; top_k a whole number >= 0 (0: off); top_p in (0, 1] (1: off)."""
  t = number("temperature", temperature, lo=0.0, hi=MAX_TEMPERATURE, cli=cli)
  if 0.0 < t < MIN_TEMPERATURE:
    raise JaxvtError(f"{_label('temperature', cli)} must be 0 (greedy) or at least "
                     f"{MIN_TEMPERATURE:g} (got {_show(temperature)})")
  k = whole("top_k", top_k, 0, INT32_MAX, cli)
  p = number("top_p", top_p, lo=0.0, hi=1.0, lo_open=True, cli=cli)
  return t, k, p


def top_k_for(top_k: int, vocab: int) -> int:
  """The top-k that sampling over `vocab` logits uses: a k at or above the vocabulary keeps
  every token, which is what 0 means, so it becomes 0."""
  return 0 if top_k >= vocab else top_k


def offload_gb(value: Any, cli: bool = False, name: str = "offload_gb") -> float | str:
  """'auto', or GiB in [0, MAX_GIB] (a string such as "7" or "auto" from the command line)."""
  if isinstance(value, str):
    s = value.strip()
    if s.lower() == "auto":
      return "auto"
    try:
      value = float(s)
    except ValueError:
      raise JaxvtError(f"{_label(name, cli)} takes a number of GiB or 'auto' "
                       f"(got {_show(s)})") from None
  return number(name, value, lo=0.0, hi=MAX_GIB, cli=cli)


def expert_cache_gb(value: Any, cli: bool = False) -> float | str:
  """The expert cache's size: 'auto' (None too), or GiB in [0, MAX_GIB] (0: no cache)."""
  return "auto" if value is None else offload_gb(value, cli, "expert_cache_gb")


def device_gb(value: Any, cli: bool = False) -> float | None:
  """None, or GiB in (0, MAX_GIB]."""
  if value is None:
    return None
  return number("device_gb", value, lo=0.0, hi=MAX_GIB, lo_open=True, cli=cli)


def processes(num_processes: Any, process_id: Any, cli: bool = False) -> tuple[int, int]:
  n = whole("num_processes", num_processes, 1, 1 << 16, cli)
  return n, whole("process_id", process_id, 0, n - 1, cli)


def text(value: Any, what: str = "the prompt") -> str:
  """`value` (str, or bytes holding UTF-8) as a str that encodes to UTF-8; JaxvtError naming
  the first byte that is not UTF-8. A str with lone surrogates (undecodable bytes smuggled
  through Python's surrogateescape, as command-line arguments are) is refused the same way."""
  if isinstance(value, (bytes, bytearray, memoryview)):
    raw = bytes(value)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise JaxvtError(f"{what} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                       f"{e.start}); pass UTF-8 text (e.g. convert it with iconv -t UTF-8)") from None
  if not isinstance(value, str):
    raise JaxvtError(f"{what} must be text (str or UTF-8 bytes), not {type(value).__name__}")
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    bad = value[e.start]
    if "\udc80" <= bad <= "\udcff":  # surrogateescape: the byte the shell or file held
      offset = len(value[:e.start].encode("utf-8", "surrogateescape"))
      raise JaxvtError(f"{what} is not valid UTF-8 (byte 0x{ord(bad) - 0xdc00:02x} at offset "
                       f"{offset}); pass UTF-8 text (e.g. convert it with iconv -t UTF-8)"
                       ) from None
    raise JaxvtError(f"{what} holds a lone surrogate (U+{ord(bad):04X} at character "
                     f"{e.start}), which is not text; pass valid Unicode") from None
  return value


def token_ids(values: Iterable[Any], vocab: int, what: str = "the prompt") -> list[int]:
  """Token ids as a list of ints, each in [0, vocab)."""
  try:
    items = list(values)
  except TypeError:
    raise JaxvtError(f"{what} must be text or a list of token ids, not "
                     f"{type(values).__name__}") from None
  out = []
  for i, v in enumerate(items):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
      raise JaxvtError(f"{what}: token {i} is {_show(v)}, not a token id (a whole number)")
    if not 0 <= int(v) < vocab:
      raise JaxvtError(f"{what}: token id {int(v)} (at {i}) is outside the vocabulary "
                       f"[0, {vocab})")
    out.append(int(v))
  return out
