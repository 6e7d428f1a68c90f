"""Benchmark `mtpjax.convert` on a generated GLM-4.x MoE GGUF of a chosen size, or on --source.

  PYTHONPATH=. python tools/bench_convert.py --hidden 256 --layers 4 --experts 16 --expert_ffn 256 \
      --vocab 4096 --tensor_type Q8_0 --dtype bfloat16
  python -m tools.bench_convert --source=/tmp/flash4.gguf --dtype=bfloat16 --decode_tokens=8

With --decode_tokens the checkpoint is restored (`mtpjax.load`) and decodes that many greedy
tokens (MTP off) from a fixed prompt, beside the source loaded directly: the round trip of a
real-shape model (tools/make_synthetic.py) on one host, with the restored parameters' device
bytes, the restore time and whether both decode the same tokens.

Prints one JSON line. The GGUF is written by a child process, so `peak_rss_mb` (this process's
ru_maxrss) measures imports plus the conversion, not the generator's float32 master weights;
the streaming design (docs/DECODE.md §10) predicts a peak of about one part above the baseline.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import resource
import shutil
import tempfile
import time

import numpy as np
from absl import app, flags

import mtpjax
from mtpjax.convert import convert
from mtpjax.package.reader import open_source
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf

_HIDDEN = flags.DEFINE_integer("hidden", 256, "embedding width D (a multiple of 4)")
_LAYERS = flags.DEFINE_integer("layers", 4, "trunk layers (the first is dense), plus one NextN")
_EXPERTS = flags.DEFINE_integer("experts", 16, "routed experts per MoE layer")
_EXPERT_FFN = flags.DEFINE_integer("expert_ffn", 256, "per-expert FFN width")
_VOCAB = flags.DEFINE_integer("vocab", 4096, "vocabulary size (>= 267)")
_TENSOR_TYPE = flags.DEFINE_string("tensor_type", "Q8_0", "ggml type of the 2-D/3-D weights")
_SOURCE = flags.DEFINE_string("source", None, "convert this GGUF or package instead of a "
                              "generated one (the size flags are then unused)")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 0, "restore the checkpoint and decode "
                                      "this many tokens beside the source (0: convert only)")
_WORKDIR = flags.DEFINE_string("workdir", None, "keep the GGUF and checkpoint here "
                               "(default: a temporary folder, removed afterwards)")
# --dtype and --weights are mtpjax.convert's flags, shared rather than redefined.
FLAGS = flags.FLAGS


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


def _generate(src: pathlib.Path) -> float:
  """Writes the flags' model to `src` in a child process; returns the seconds it took."""
  start = time.perf_counter()
  child = multiprocessing.get_context("spawn").Process(target=write_tiny_glm_gguf,
                                                       args=(src, _spec()))
  child.start()
  child.join()
  if child.exitcode != 0:
    raise SystemExit(f"writing {src} failed (exit code {child.exitcode})")
  return time.perf_counter() - start


def _round_trip(src, out: pathlib.Path) -> dict:
  """Restore `out`, decode --decode_tokens greedy tokens from it and from `src` loaded
  directly (MTP off, one fixed prompt): times, restored device bytes, equal tokens."""
  os.environ["MTPJAX_NATIVE_MTP"] = "0"
  start = time.perf_counter()
  restored = mtpjax.load(str(out), dtype=FLAGS.dtype)
  restore_s = time.perf_counter() - start
  direct = mtpjax.load(str(src), dtype=FLAGS.dtype, weights=FLAGS.weights)
  prompt = np.random.default_rng(0).integers(0, restored.config.vocab_size, 8).astype(np.int32)
  tokens, decode_s = {}, {}
  for name, model in (("restored", restored), ("source", direct)):
    start = time.perf_counter()
    tokens[name] = model.generate(prompt, max_new_tokens=_DECODE_TOKENS.value).tokens
    decode_s[name] = time.perf_counter() - start
  by_type = restored.weight_bytes_by_type()   # the loaded tensors: the NextN block is not
  return {"restore_seconds": round(restore_s, 3),
          "restored_device_bytes": sum(device for device, _ in by_type.values()),
          "restored_gguf_bytes": sum(gguf or 0 for _, gguf in by_type.values()),
          "decode_seconds": {k: round(v, 3) for k, v in decode_s.items()},
          "decoded_tokens": [int(t) for t in tokens["restored"]],
          "same_tokens_as_source": list(tokens["restored"]) == list(tokens["source"])}


def main(argv):
  del argv
  root = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="bench-convert-"))
  root.mkdir(parents=True, exist_ok=True)
  src, out = pathlib.Path(_SOURCE.value or root / "bench.gguf"), root / "bench-ckpt"
  try:
    generate_s = 0.0 if _SOURCE.value else _generate(src)
    with open_source(src) as source:
      infos = list(source.tensors.values())
    largest = max(infos, key=lambda info: info.n_bytes)
    gguf_bytes = sum(info.n_bytes for info in infos)
    baseline = _rss_mb()
    start = time.perf_counter()
    convert(src, out, dtype=FLAGS.dtype, weights=FLAGS.weights, overwrite=True,
            show_progress=False)
    seconds = time.perf_counter() - start
    convert_rss = _rss_mb()
    line = {
        "flags": {"source": _SOURCE.value, "hidden": _HIDDEN.value, "layers": _LAYERS.value,
                  "experts": _EXPERTS.value, "expert_ffn": _EXPERT_FFN.value,
                  "vocab": _VOCAB.value, "tensor_type": _TENSOR_TYPE.value,
                  "dtype": FLAGS.dtype, "weights": FLAGS.weights},
        "gguf_tensor_bytes": gguf_bytes,
        "tensor_count": len(infos),
        "seconds": round(seconds, 3),
        "read_mb_per_s": round(gguf_bytes / seconds / 1e6, 2),
        "peak_rss_mb": round(convert_rss, 1),
        "baseline_rss_mb": round(baseline, 1),
        "largest_tensor": largest.name,
        "largest_tensor_bytes": largest.n_bytes,
        "checkpoint_bytes": _dir_bytes(out),
        "generate_seconds": round(generate_s, 3),
    }
    if _DECODE_TOKENS.value:
      line.update(_round_trip(src, out))
      line["peak_rss_mb_with_decode"] = round(_rss_mb(), 1)
    print(json.dumps(line))
  finally:
    if _WORKDIR.value is None:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
