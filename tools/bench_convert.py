"""Benchmark `mtpjax.convert` on a generated GLM-4.x MoE GGUF of a chosen size.

  PYTHONPATH=. python tools/bench_convert.py --hidden 256 --layers 4 --experts 16 --expert_ffn 256 \
      --vocab 4096 --tensor_type Q8_0 --dtype bfloat16

Prints one JSON line. The GGUF is written by a child process, so `peak_rss_mb` (this process's
ru_maxrss) measures imports plus the conversion, not the generator's float32 master weights;
the streaming design (DECODE.md §10) predicts a peak of about one part above the baseline.
"""

from __future__ import annotations

import json
import multiprocessing
import pathlib
import resource
import shutil
import tempfile
import time

from absl import app, flags

from mtpjax.convert import convert
from mtpjax.package.reader import open_source
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf

_HIDDEN = flags.DEFINE_integer("hidden", 256, "embedding width D (a multiple of 4)")
_LAYERS = flags.DEFINE_integer("layers", 4, "trunk layers (the first is dense), plus one NextN")
_EXPERTS = flags.DEFINE_integer("experts", 16, "routed experts per MoE layer")
_EXPERT_FFN = flags.DEFINE_integer("expert_ffn", 256, "per-expert FFN width")
_VOCAB = flags.DEFINE_integer("vocab", 4096, "vocabulary size (>= 267)")
_TENSOR_TYPE = flags.DEFINE_string("tensor_type", "Q8_0", "ggml type of the 2-D/3-D weights")
_WORKDIR = flags.DEFINE_string("workdir", None, "keep the GGUF and checkpoint here "
                               "(default: a temporary folder, removed afterwards)")
FLAGS = flags.FLAGS   # --dtype is mtpjax.convert's own flag, shared rather than redefined


def _spec() -> TinyGlmSpec:
  hidden = _HIDDEN.value
  return TinyGlmSpec(
      vocab_size=_VOCAB.value, hidden=hidden, n_heads=4, n_kv_heads=2, head_dim=hidden // 4,
      rope_dims=max(2, hidden // 8 // 2 * 2), n_trunk_layers=_LAYERS.value, leading_dense=1,
      ffn=2 * hidden, n_experts=_EXPERTS.value, n_experts_used=min(4, _EXPERTS.value),
      expert_ffn=_EXPERT_FFN.value, n_groups=1, groups_used=1, tensor_type=_TENSOR_TYPE.value)


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def _dir_bytes(path: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv):
  del argv
  spec = _spec()
  root = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="bench-convert-"))
  root.mkdir(parents=True, exist_ok=True)
  src, out = root / "bench.gguf", root / "bench-ckpt"
  try:
    start = time.perf_counter()
    child = multiprocessing.get_context("spawn").Process(target=write_tiny_glm_gguf,
                                                         args=(src, spec))
    child.start()
    child.join()
    if child.exitcode != 0:
      raise SystemExit(f"writing {src} failed (exit code {child.exitcode})")
    generate_s = time.perf_counter() - start

    with open_source(src) as source:
      infos = list(source.tensors.values())
    largest = max(infos, key=lambda info: info.n_bytes)
    gguf_bytes = src.stat().st_size
    baseline = _rss_mb()
    start = time.perf_counter()
    convert(src, out, dtype=FLAGS.dtype, overwrite=True, show_progress=False)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "flags": {"hidden": _HIDDEN.value, "layers": _LAYERS.value, "experts": _EXPERTS.value,
                  "expert_ffn": _EXPERT_FFN.value, "vocab": _VOCAB.value,
                  "tensor_type": _TENSOR_TYPE.value, "dtype": FLAGS.dtype},
        "gguf_bytes": gguf_bytes,
        "tensor_count": len(infos),
        "seconds": round(seconds, 3),
        "read_mb_per_s": round(gguf_bytes / seconds / 1e6, 2),
        "peak_rss_mb": round(_rss_mb(), 1),
        "baseline_rss_mb": round(baseline, 1),
        "largest_tensor": largest.name,
        "largest_tensor_bytes": largest.n_bytes,
        "checkpoint_bytes": _dir_bytes(out),
        "generate_seconds": round(generate_s, 3),
    }))
  finally:
    if _WORKDIR.value is None:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
