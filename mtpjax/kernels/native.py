"""Native CPU kernels, compiled once per machine and registered with XLA as FFI targets.

`quant_matvec.cc` (with `quant_product.h` and `quant_blocks.h`) contracts a few rows against
GGUF-quantized matrices reading each block's integers once, several tensors or a whole SwiGLU
in one call, and `paged_attention.cc` attends a step's few query rows over a paged GQA cache
reading each row once (see their headers). They are built on first use into one library with
the C++ compiler (`$CXX`, else `g++`) for this CPU (`-march=native`, or `$MTPJAX_NATIVE_MARCH`)
against the FFI headers jaxlib ships, into `$MTPJAX_CACHE_DIR/native` (default
`~/.cache/mtpjax/native`), keyed by the sources, the flags, the compiler's identity, jaxlib's
version and the CPU, so later processes only load it. `mtpjax.load` builds it (`available()`),
never a trace; a build has a time limit, a cached library that does not load is built again
once, and builds unused for `_PRUNE_AFTER_S` are removed. Where no compiler works, or
`MTPJAX_NATIVE=0`, `available()` is False and the callers keep their XLA paths (logged once)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

_HERE = pathlib.Path(__file__).parent
_UNITS = (_HERE / "quant_matvec.cc", _HERE / "paged_attention.cc")   # compiled into one library
_SOURCES = (*_UNITS, *(_HERE / h for h in (   # built from
    "quant_product.h", "int8_rows.h", "quant_blocks.h", "shared_tasks.h", "simd_math.h")))
_TARGET = "mtpjax_quant_matvec"
_SWIGLU_TARGET = "mtpjax_quant_swiglu"
_ATTENTION_TARGET = "mtpjax_paged_attention"
_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
# GGUF type names in the kernel's TypeCode order.
TYPE_NAMES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Rows one kernel call takes (its kMaxRows); `quant_matvec` splits longer calls.
MAX_ROWS = 4096
_BUILD_TIMEOUT_S = 600          # a build takes seconds; a hung compiler must not hang a load
_PRUNE_AFTER_S = 30 * 86400     # libraries no process has loaded for 30 days

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> pathlib.Path:
  root = os.environ.get("MTPJAX_CACHE_DIR") or pathlib.Path.home() / ".cache" / "mtpjax"
  return pathlib.Path(root) / "native"


def _cpu_key() -> str:
  """The CPU the library is built for (-march=native): its model and feature flags."""
  try:
    info = pathlib.Path("/proc/cpuinfo").read_text()
    lines = [l for l in info.splitlines() if l.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def _flags() -> tuple[str, ...]:
  """Compiler flags: the target is this CPU unless `MTPJAX_NATIVE_MARCH` names another (e.g.
  x86-64, with no AVX2: the portable path, as on a CPU without it)."""
  return (*_FLAGS, f"-march={os.environ.get('MTPJAX_NATIVE_MARCH', 'native')}")


def _compiler() -> str:
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not compiler:
    raise RuntimeError("no C++ compiler (set CXX or install g++)")
  return compiler


def _compiler_identity(compiler: str) -> str:
  """The compiler's path and `--version`: another compiler (or version) is another build."""
  try:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
  except (OSError, subprocess.TimeoutExpired) as e:
    raise RuntimeError(f"cannot run the C++ compiler {compiler}: {e}") from e
  return f"{shutil.which(compiler) or compiler}\n{version}"


def library_path() -> pathlib.Path:
  key = hashlib.sha256("\0".join(
      (*(p.read_text() for p in _SOURCES), " ".join(_flags()), _compiler_identity(_compiler()),
       jaxlib.__version__, platform.machine(), _cpu_key())).encode()).hexdigest()[:16]
  return cache_dir() / f"quant_matvec-{key}.so"


def _compile(out: pathlib.Path) -> None:
  """Builds the library into a temporary file beside `out`, then renames it into place (two
  processes building at once each write their own file; the last rename wins, same bytes)."""
  compiler = _compiler()
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  try:
    subprocess.run([compiler, *_flags(), f"-I{jax.ffi.include_dir()}", *map(str, _UNITS),
                    "-o", tmp], check=True, capture_output=True, text=True,
                   timeout=_BUILD_TIMEOUT_S)
    os.replace(tmp, out)
  except subprocess.CalledProcessError as e:
    raise RuntimeError(f"{compiler} failed on {_HERE}:\n{e.stderr[-2000:]}") from e
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"{compiler} took over {_BUILD_TIMEOUT_S} s on {_HERE}") from e
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _prune(keep: pathlib.Path) -> None:
  """Removes the cache's other builds that no process has loaded for `_PRUNE_AFTER_S`."""
  old = time.time() - _PRUNE_AFTER_S
  for build in keep.parent.glob("quant_matvec-*.so"):
    try:
      if build != keep and build.stat().st_mtime < old:
        build.unlink()
    except OSError:
      pass


def _open_library(path: pathlib.Path) -> ctypes.CDLL:
  """The built library at `path` (built now if missing), its targets registered with XLA; a
  cached build that does not load (truncated, another ABI) is built again once."""
  started, built = time.perf_counter(), False
  if not path.exists():
    _compile(path)
    built = True
  try:
    library = ctypes.CDLL(str(path))
    symbols = (library.MtpjaxQuantMatvec, library.MtpjaxQuantSwiglu,
               library.MtpjaxPagedAttention, library.MtpjaxIntegerRows)
  except (OSError, AttributeError) as e:
    if built:
      raise RuntimeError(f"the library just built does not load: {e}") from e
    logging.warning("the cached native kernels at %s do not load (%s); building them again",
                    path, e)
    path.unlink(missing_ok=True)
    return _open_library(path)
  for target, symbol in zip((_TARGET, _SWIGLU_TARGET, _ATTENTION_TARGET), symbols):
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
  os.utime(path)     # marks it used, so `_prune` keeps it
  _prune(path)
  logging.info("native CPU kernels %s %s in %.1f s", "built into" if built else "loaded from",
               path, time.perf_counter() - started)
  return library


def available() -> bool:
  """Whether the native kernels are built, loaded and registered (building them if needed)."""
  with _lock:
    if "ok" not in _state:
      _state["ok"] = _load()
    return bool(_state["ok"])


def _load() -> bool:
  if os.environ.get("MTPJAX_NATIVE", "1") == "0":
    logging.info("native CPU kernels off (MTPJAX_NATIVE=0)")
    return False
  try:
    library = _open_library(library_path())
  except (OSError, RuntimeError) as e:
    logging.warning("native CPU kernels unavailable, using XLA's paths: %s", e)
    return False
  _state["library"] = library     # keeps the handler's code loaded
  return True


def _require() -> None:
  if not available():
    raise RuntimeError("native CPU kernels are not available (see the log)")


def integer_rows(type_name: str) -> bool:
  """Whether int8 rows against `type_name` multiply as integers here (the kernel says: its AVX2
  paths, all types but Q2_K and Q3_K): then it takes a prefill's rows too
  (`quantized.takes_native`)."""
  return (type_name in TYPE_NAMES and available()
          and bool(_state["library"].MtpjaxIntegerRows(TYPE_NAMES.index(type_name))))


# A tensor as the kernel reads it: (GGUF type name, fields shaped `[E, N, nb, ...]` in
# `quant_blocks.field_specs` order).
Tensor = tuple[str, list[jax.Array]]


def quant_matvec(x: jax.Array, ids: jax.Array | None, type_name: str, fields: list[jax.Array],
                 int8_activations: bool = False) -> jax.Array:
  """Rows `x [R, K]` against quantized matrices: row r against matrix
  `ids[r]` of fields shaped `[E, N, nb, ...]` (`quant_blocks.field_specs` order; ids None:
  every row against matrix 0): `[R, N]` float32. `int8_activations`: each row of x rounded
  per weight block (32 values, 256 for K-quants) to int8 and a float32 scale, as llama.cpp
  multiplies (about 3x less arithmetic; a result is the exact weights' product with the
  rounded row); Q2_K / Q3_K, and every type where the CPU has no AVX2 (the portable path), keep
  float32 rows. Only where `available()`."""
  return quant_matvecs(x, ids, [(type_name, fields)], [int8_activations])[0]


def quant_matvecs(x: jax.Array, ids: jax.Array | None, tensors: list[Tensor],
                  int8_activations: list[bool]) -> list[jax.Array]:
  """`quant_matvec` of the same rows against several tensors in one call (q, k and v of one
  x): a `[R, N_i]` result each, equal to its own call's, for one call's fixed cost."""
  return _call(_TARGET, x, ids, tensors, int8_activations,
               [fields[0].shape[1] for _, fields in tensors])


def quant_swiglu(x: jax.Array, ids: jax.Array | None, gate: Tensor, up: Tensor, down: Tensor,
                 int8_activations: list[bool]) -> jax.Array:
  """A SwiGLU feed-forward in one call: `down(silu(gate(x)) * up(x))`, row r through matrix
  `ids[r]` of each (an expert; ids None: matrix 0): `[R, D]` float32. Each contraction is
  `quant_matvec`'s; silu(g) * u is computed in float32 between them (g / (1 + exp(-g)) * u, its
  exp within 2 ulp; 0 past g = -88.7, as XLA's). Only where `available()`."""
  return _call(_SWIGLU_TARGET, x, ids, [gate, up, down], int8_activations,
               [down[1][0].shape[1]])[0]


def _call(target: str, x: jax.Array, ids: jax.Array | None, tensors: list[Tensor],
          int8_activations: list[bool], widths: list[int]) -> list[jax.Array]:
  """One call of a quantized-matrix target over the fields of `tensors` in order: `[R, width]`
  float32 results, at most MAX_ROWS rows a call (a row's result does not depend on the others,
  so longer calls split exactly)."""
  _require()
  flat = [f for _, fields in tensors for f in fields]
  codes = {"type_codes": np.array([TYPE_NAMES.index(t) for t, _ in tensors], np.int32),
           "int8_x": np.array([bool(i) for i in int8_activations], np.int32)}
  x = x.astype(jnp.float32)
  ids = jnp.zeros((x.shape[0],), jnp.int32) if ids is None else ids.astype(jnp.int32)

  def call(r0: int, r1: int) -> list[jax.Array]:
    out = [jax.ShapeDtypeStruct((r1 - r0, width), jnp.float32) for width in widths]
    return list(jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        x[r0:r1], ids[r0:r1], *flat, **codes))

  if x.shape[0] <= MAX_ROWS:
    return call(0, x.shape[0])
  parts = [call(r, min(r + MAX_ROWS, x.shape[0])) for r in range(0, x.shape[0], MAX_ROWS)]
  return [jnp.concatenate(results) for results in zip(*parts)]


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                    positions: jax.Array) -> jax.Array:
  """Query rows `q [b, T, Hkv, g, hd]` (scaled) attending to rows j <= `positions [b, T]` of
  their slot in the pools `k [P, Hkv, R, hd]`, `v [P, Hkv, vd, R]` (float32, float16, or
  bfloat16 stored as uint16 bits) through the page table `[b, max_pages]`: `[b, T, Hkv, g, vd]`
  float32. Only where `available()`."""
  _require()
  b, t, hkv, g, _ = q.shape
  out = jax.ShapeDtypeStruct((b, t, hkv, g, v_pool.shape[2]), jnp.float32)
  call = jax.ffi.ffi_call(_ATTENTION_TARGET, out, vmap_method="sequential")
  return call(q.astype(jnp.float32), k_pool, v_pool, table.astype(jnp.int32),
              positions.astype(jnp.int32))
