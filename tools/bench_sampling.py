"""What a decode step's sampling costs over a real vocabulary, per sampler; one JSON line.

`engine.sampling.sample` over [--rows, --vocab] logits (GLM-4.7-Flash's 154,880 by default), for
greedy rows and for sampled rows with each sampler of --samplers, on two logit profiles:
`peaked` (Zipf, exponent 2: a trained model's usual row, its top-p nucleus a few tokens) and
`flat` (normal, std 3: the nucleus of top_p 0.95 is thousands of tokens, past the candidates, so
each row searches its whole row). Beside them, a sort of the same rows: what the top-k / top-p
rule cost every sampled row when it sorted the vocabulary. The variants of a row count are
timed alternately in one process (bench_moe's timing), the best of --repeats each.

  python -m tools.bench_sampling --rows=1,8 --samplers=1.0:0:1.0,1.0:0:0.95,0.8:40:0.95
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from mtpjax.engine.sampling import CANDIDATES, request_key, sample
# bench_moe's timing (the variants alternated in one process, the best of --repeats each) and
# its --repeats flag (absl flags are global: read, not redefined).
from tools.bench_moe import _REPEATS, _best_ms

_VOCAB = flags.DEFINE_integer("vocab", 154_880, "vocabulary size")
_ROWS = flags.DEFINE_list("rows", ["1", "8"], "rows per call (slots x verify rows)")
_SAMPLERS = flags.DEFINE_list("samplers", ["1.0:0:1.0", "1.0:0:0.95", "0.8:40:0.95"],
                              "temperature:top_k:top_p of the sampled rows")


def _profiles(rng, vocab: int) -> dict[str, np.ndarray]:
  rank = rng.permutation(vocab) + 1.0
  return {"peaked": (-2.0 * np.log(rank)).astype(np.float32),
          "flat": (3.0 * rng.standard_normal(vocab)).astype(np.float32)}


def _parse(sampler: str) -> tuple[float, int, float]:
  try:
    temperature, top_k, top_p = sampler.split(":")
    return float(temperature), int(top_k), float(top_p)
  except ValueError as exc:
    raise app.UsageError(f"--samplers takes temperature:top_k:top_p, not {sampler!r}") from exc


def main(argv):
  del argv
  samplers = {s: _parse(s) for s in _SAMPLERS.value}
  rng = np.random.default_rng(0)
  fn = jax.jit(sample)
  sort = jax.jit(lambda rows: jnp.sort(rows, axis=-1))
  results = {}
  for name, row in _profiles(rng, _VOCAB.value).items():
    for n in (int(r) for r in _ROWS.value):
      logits = jnp.asarray(np.broadcast_to(row, (n, row.size)))
      keys = jnp.asarray(np.stack([request_key(i) for i in range(n)]))
      positions = jnp.arange(n, dtype=jnp.int32)
      params = lambda t, k, p, n=n: (jnp.full((n,), t, jnp.float32), jnp.full((n,), k, jnp.int32),
                                     jnp.full((n,), p, jnp.float32))
      variants = {"greedy": (logits, keys, positions, *params(0.0, 0, 1.0)),
                  **{f"sampled_{label}": (logits, keys, positions, *params(*values))
                     for label, values in samplers.items()}}
      ms = _best_ms({**dict.fromkeys(variants, fn), "sort_of_the_rows": sort},
                    {**variants, "sort_of_the_rows": (logits,)})
      results[f"{name}_rows{n}"] = {f"{v}_ms": round(value, 3) for v, value in ms.items()}
  print(json.dumps({
      "flags": {f.name: f.value for f in (_VOCAB, _ROWS, _SAMPLERS, _REPEATS)},
      "candidates": CANDIDATES, "device": jax.devices()[0].device_kind, "ms": results}))


if __name__ == "__main__":
  app.run(main)
