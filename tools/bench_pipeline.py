"""Pipeline benchmark: tokens/s and per-device parameter bytes, one JSON line per configuration.

  python tools/bench_pipeline.py [--devices 1,2,4] [--batches 1,8] [--new-tokens 32] [--mtp]

Runs on simulated CPU devices (one stage per device) with a generated tiny GLM unless
`--source` names a package or GGUF. A first run per configuration compiles and is not timed.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", default="1,2,4", help="stage counts (one device each)")
  parser.add_argument("--batches", default="1,8", help="slots (concurrent requests)")
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--prompt-tokens", type=int, default=12)
  parser.add_argument("--mtp", action="store_true", help="decode with the native MTP head")
  parser.add_argument("--source", default=None, help="package or GGUF (default: tiny GLM)")
  return parser.parse_args()


def main() -> None:
  args = _parse()
  stage_counts = [int(x) for x in args.devices.split(",")]
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("XLA_FLAGS",
                        f"--xla_force_host_platform_device_count={max(stage_counts)}")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import json
  import tempfile
  import time

  import jax
  import numpy as np

  from mtpjax.engine.scheduler import Request, SlotScheduler
  from mtpjax.api import load_pipelined
  from mtpjax.testing.tiny_glm import write_tiny_glm_gguf

  with tempfile.TemporaryDirectory() as tmp:
    source = args.source
    if source is None:
      source = os.path.join(tmp, "tiny.gguf")
      write_tiny_glm_gguf(source)
    for stages in stage_counts:
      model = load_pipelined(source, dtype="float32", stages=stages)
      per_device = {d: 0 for d in jax.devices()}
      for _, state in model.weights(with_mtp=args.mtp):
        for leaf in jax.tree.leaves(state):
          for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
      used = [per_device[m.devices.flat[0]] for m in model.plan.meshes]
      for batch in (int(x) for x in args.batches.split(",")):
        engine = model.engine(native_mtp=args.mtp, slots=batch,
                              max_len=args.prompt_tokens + args.new_tokens + 8)
        rng = np.random.default_rng(0)
        def requests():
          return [Request(prompt=rng.integers(1, model.config.vocab_size, args.prompt_tokens),
                          max_new_tokens=args.new_tokens) for _ in range(batch)]
        SlotScheduler(engine).run(requests())               # compile
        start = time.perf_counter()
        results = SlotScheduler(engine).run(requests())
        elapsed = time.perf_counter() - start
        generated = sum(len(r.tokens) for r in results)
        print(json.dumps({
            "devices": stages, "stages": stages, "batch": batch, "native_mtp": args.mtp,
            "microbatches": len(getattr(engine, "bounds", [(0, batch)])),
            "new_tokens": generated, "seconds": round(elapsed, 4),
            "tokens_per_s": round(generated / elapsed, 2),
            "param_bytes_per_device": used, "param_bytes_max_device": max(used),
            "param_bytes_total": sum(used)}), flush=True)


if __name__ == "__main__":
  main()
