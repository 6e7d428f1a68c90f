"""Writes a synthetic GGUF with the real dimensions of a named GLM variant; one JSON line.

Few trunk layers plus the NextN block, random weights (mtpjax/testing/synthetic_glm.py). With
--llama_quantize the model is written as F16 and quantized by llama.cpp (real K-quants and
llama.cpp's per-tensor type mix, e.g. Q6_K output head in Q4_K_M); the F16 intermediate is
deleted. Without it the chosen type is written directly: gguf-py quantizes Q8_0/Q4_0/...,
K-quants get random blocks with finite f16 scales, and a llama.cpp mix name (Q4_K_M) is
written as its base type (Q4_K) throughout.

  python -m tools.make_synthetic --variant=glm-4.7-flash --layers=4 --type=Q4_K_M \\
      --llama_quantize=/tmp/llama.cpp-0c1e570/llama-quantize --out=/tmp/flash4.gguf
  python -m tools.make_synthetic --variant=glm-4.5-air --layers=2 --dims=hidden=256,vocab_size=1024 \\
      --type=Q8_0 --out=/tmp/air-small.gguf --package=/tmp/air-small-package
"""

from __future__ import annotations

import json
import math
import pathlib
import time

from absl import app, flags

from mtpjax.package.writer import split_gguf
from mtpjax.testing.glm_variants import VARIANTS, with_dims
from mtpjax.testing.synthetic_glm import tensor_shapes, write_synthetic_gguf
from tools import llama_cpp

# llama-quantize's mixes -> the one type written without it.
_BASE_TYPE = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K",
              "Q3_K_M": "Q3_K", "Q3_K_S": "Q3_K", "Q3_K_L": "Q3_K", "Q2_K_S": "Q2_K"}
_DIRECT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                 "Q4_K", "Q5_K", "Q6_K")

_VARIANT = flags.DEFINE_enum("variant", "glm-4.7-flash", sorted(VARIANTS), "named GLM variant")
_LAYERS = flags.DEFINE_integer("layers", 4, "trunk layers written (the NextN block is added)")
_TYPE = flags.DEFINE_string("type", "Q4_K_M", "tensor type: a llama-quantize type name with "
                            "--llama_quantize, else one of " + ", ".join(_DIRECT_TYPES)
                            + " (or a K mix such as Q4_K_M, written as its base type)")
_OUT = flags.DEFINE_string("out", None, "output .gguf path", required=True)
_LLAMA_QUANTIZE = flags.DEFINE_string("llama_quantize", "", "path of llama.cpp's llama-quantize "
                                      "(its folder goes on LD_LIBRARY_PATH)")
_THREADS = flags.DEFINE_integer("threads", 2, "llama-quantize threads")
_PACKAGE = flags.DEFINE_string("package", "", "also write a layer package into this folder")
_DIMS = flags.DEFINE_list("dims", [], "dimension overrides name=value (a smaller model of the "
                          "same shape family), e.g. hidden=256,n_experts=8,vocab_size=1024")
_SEED = flags.DEFINE_integer("seed", 0, "weight seed")


def main(argv):
  del argv
  try:
    variant = with_dims(VARIANTS[_VARIANT.value],
                        dict(item.split("=", 1) for item in _DIMS.value))
  except ValueError as exc:
    raise app.UsageError(f"--dims: {exc}") from exc
  if _LAYERS.value < 1:
    raise app.UsageError(f"--layers must be >= 1, got {_LAYERS.value}")
  qtype = _TYPE.value.upper()
  direct = _BASE_TYPE.get(qtype, qtype)
  if not _LLAMA_QUANTIZE.value and direct not in _DIRECT_TYPES:
    raise app.UsageError(f"--type={qtype} needs --llama_quantize; without it use one of "
                         f"{', '.join(_DIRECT_TYPES)}")
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  if _LLAMA_QUANTIZE.value:
    f16 = out.with_name(out.name + ".f16.tmp")
    try:
      write_synthetic_gguf(f16, variant, _LAYERS.value, tensor_type="F16", seed=_SEED.value)
      llama_cpp.run(_LLAMA_QUANTIZE.value, str(f16), str(out), qtype, str(_THREADS.value))
    finally:
      f16.unlink(missing_ok=True)
    written_as = f"{qtype} (llama-quantize from F16)"
  else:
    write_synthetic_gguf(out, variant, _LAYERS.value, tensor_type=direct, seed=_SEED.value)
    written_as = direct if direct == qtype else f"{direct} (random blocks; no llama-quantize)"
  write_s = time.perf_counter() - start
  if _PACKAGE.value:
    split_gguf(out, _PACKAGE.value, model_id=f"synthetic/{variant.name}", overwrite=True)
  params = sum(math.prod(shape) for shape in tensor_shapes(variant, _LAYERS.value).values())
  print(json.dumps({
      "flags": {f.name: f.value for f in (_VARIANT, _LAYERS, _TYPE, _OUT, _LLAMA_QUANTIZE,
                                          _PACKAGE, _DIMS, _SEED)},
      "variant": variant.name, "arch": variant.arch, "hf_repo": variant.hf_repo,
      "trunk_layers": _LAYERS.value, "real_layers": variant.real_layers,
      "parameters": params, "written_as": written_as, "file_bytes": out.stat().st_size,
      "package": _PACKAGE.value or None, "seconds": round(write_s, 1)}), flush=True)


if __name__ == "__main__":
  app.run(main)
