"""Train the offline demo model: a small GLM-4.x MoE with a real NextN (MTP) head.

    python -m tools.train_demo --out=mtpjax/assets/glm-demo   # the shipped model (defaults)

Deterministic for a given seed and interpreter: the corpus is the running interpreter's own
standard-library sources (no download), excluding tests and generated tables. The loss is
`CE_trunk + mtp_weight * sum_d w_d CE_mtp_d` with the MTP row convention of MODEL.md §7 (row p
pairs x_p with the trunk hidden h_{p-1}, zero for row 0, and predicts x_{p+1}). Depth d > 1
(`--mtp_depth_weights`, one weight per depth) trains the recursive draft chain the engine runs:
the same block over rows pairing x_p with its own depth d - 1 output y_{p-1} (before the head
norm, as the chain feeds it back), teacher-forced with the true tokens. The forward is
`mtpjax.models` itself; only the optimiser loop and the export live here. The result is written
with mtpjax's GGUF writer in llama.cpp's `glm4moe` layout, then split into a layer package,
with a MODEL_CARD.md holding the flags and held-out metrics.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtpjax import loading
from mtpjax.gguf.tokenizer import GgufTokenizer, glm_pre_tokenizer
from mtpjax.models.config import ModelConfig
from mtpjax.engine.steps import fresh_forward, fresh_mtp_rows
from mtpjax.models import registry
from mtpjax.models.interface import StageLayout, previous_hidden
from mtpjax.package.writer import split_gguf
from mtpjax.testing import tiny_glm
from mtpjax.testing.corpus import split_corpus

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "mtpjax/assets/glm-demo", "package directory to write")
flags.DEFINE_integer("steps", 800, "optimizer steps")
flags.DEFINE_integer("batch", 16, "sequences per step")
flags.DEFINE_integer("seq_len", 128, "tokens per training sequence")
flags.DEFINE_float("lr", 3e-3, "peak learning rate")
flags.DEFINE_float("mtp_weight", 0.3, "weight of the MTP cross-entropy")
flags.DEFINE_list("mtp_depth_weights", ["1"], "per draft depth 1..D, its share of mtp_weight "
                  "(one entry: the single-token head the shipped demo was trained with)")
flags.DEFINE_integer("vocab", 4096, "byte-level BPE vocabulary size (GLM specials included)")
flags.DEFINE_integer("hidden", 256, "model width")
flags.DEFINE_integer("layers", 4, "trunk layers (layer 0 dense, MoE after)")
flags.DEFINE_integer("experts", 8, "routed experts")
flags.DEFINE_integer("expert_ffn", 128, "per-expert FFN width")
flags.DEFINE_integer("seed", 0, "seed for data order and initialisation")
flags.DEFINE_integer("eval_batches", 8, "held-out batches for the metrics")
flags.DEFINE_string("tensor_type", "Q8_0", "GGUF storage type of the weight matrices")
flags.DEFINE_integer("corpus_files", 0, "use only the first N corpus files (0: all)")

def train_tokenizer(texts: list[str], vocab_size: int) -> dict:
  """GGUF tokenizer key/values of a byte-level BPE trained with GLM's pre-tokenizer."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = glm_pre_tokenizer()
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(tiny_glm.SPECIAL_TOKENS),
                                show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  model = json.loads(tok.to_str())["model"]
  vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  tokens = [t for t, _ in vocab]
  return tiny_glm.glm_tokenizer_metadata(tokens, [1] * len(tokens), merges)


def model_spec(vocab_size: int) -> tiny_glm.TinyGlmSpec:
  return tiny_glm.TinyGlmSpec(
      vocab_size=vocab_size, hidden=FLAGS.hidden, n_heads=4, n_kv_heads=2,
      head_dim=FLAGS.hidden // 4, n_trunk_layers=FLAGS.layers, leading_dense=1,
      ffn=3 * FLAGS.hidden, n_experts=FLAGS.experts, n_experts_used=2, n_shared_experts=1,
      expert_ffn=FLAGS.expert_ffn, n_groups=1, groups_used=1, rope_dims=FLAGS.hidden // 8,
      attn_bias=True, qk_norm=False, tied_head=False, mtp=True, nextn_embed=False,
      nextn_head=False, nextn_head_norm=True, routed_scale=1.0, context_length=2048,
      tensor_type=FLAGS.tensor_type, seed=FLAGS.seed)


def model_config(spec: tiny_glm.TinyGlmSpec) -> ModelConfig:
  return ModelConfig(
      arch="glm4moe", vocab_size=spec.vocab_size, hidden=spec.hidden,
      n_layers=spec.n_trunk_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
      head_dim=spec.head_dim, value_dim=spec.head_dim, rope_dims=spec.rope_dims,
      rope_theta=spec.rope_theta, eps=spec.eps, ffn=spec.ffn, leading_dense=spec.leading_dense,
      n_experts=spec.n_experts, n_experts_used=spec.n_experts_used,
      n_shared_experts=spec.n_shared_experts, expert_ffn=spec.expert_ffn, n_groups=1,
      groups_used=1, gating="sigmoid", routed_scale=spec.routed_scale, norm_topk=spec.norm_topk,
      context_length=spec.context_length, attn_bias=spec.attn_bias, qk_norm=spec.qk_norm,
      tied_head=False, has_mtp=True, mtp_embed=False, mtp_head=False, mtp_head_norm=True)


def init_params(cfg: ModelConfig, layout: StageLayout, seed: int):
  """Normal(0, 0.02) matrices, unit norms, zero biases; returns (graphdef, state)."""
  graphdef, abstract = loading.abstract_model(cfg, layout, "float32")
  transposed = loading.linear_weight_paths(abstract)
  rng = np.random.default_rng(seed)
  leaves = {}
  for path, leaf in sorted(loading.flat_paths(abstract).items(), key=lambda kv: str(kv[0])):
    name = path[-2] if path[-1] == "weight" else path[-1]
    if path[-1] == "weight" and "norm" in str(name):
      value = np.ones(leaf.shape, np.float32)
    elif path[-1] in ("bias", "router_bias"):
      value = np.zeros(leaf.shape, np.float32)
    elif path in transposed:   # drawn in GGUF order, so a seed gives the same model as before
      value = rng.normal(0.0, 0.02, leaf.shape[::-1]).astype(np.float32).T
    else:
      value = rng.normal(0.0, 0.02, leaf.shape).astype(np.float32)
    leaves[path] = jnp.asarray(value)
  return loading.assemble(graphdef, abstract, leaves)


def losses(graphdef, state, tokens, mtp_weight, depth_weights):
  """(total, (trunk CE, MTP CE per depth [D], MTP/trunk argmax agreement per depth [D])) over
  a [B, T] batch; depth d's block reads its own depth d - 1 output (see the module doc)."""
  model = nnx.merge(graphdef, state)
  hidden, _, _ = fresh_forward(model, tokens, tokens.shape[1])
  trunk_logits = model.lm_logits(hidden)[:, :-1]
  targets = tokens[:, 1:]
  ce_trunk = optax.softmax_cross_entropy_with_integer_labels(trunk_logits, targets).mean()
  prev, ce_mtp, agree = previous_hidden(hidden), [], []
  for _ in depth_weights:
    z, y = fresh_mtp_rows(model, tokens, prev)
    mtp_logits = model.mtp_logits(z)[:, :-1]
    ce_mtp.append(optax.softmax_cross_entropy_with_integer_labels(mtp_logits, targets).mean())
    agree.append((jnp.argmax(mtp_logits, -1) == jnp.argmax(trunk_logits, -1)).mean())
    prev = previous_hidden(y)
  ce_mtp, agree = jnp.stack(ce_mtp), jnp.stack(agree)
  total = ce_trunk + mtp_weight * jnp.dot(jnp.asarray(depth_weights, jnp.float32), ce_mtp)
  return total, (ce_trunk, ce_mtp, agree)


def batches(ids: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
  while True:
    starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
    yield np.stack([ids[s:s + seq_len] for s in starts]).astype(np.int32)


def export(graphdef, state, spec, cfg, tokenizer_meta, out_dir: pathlib.Path, card: dict):
  """Float32 params -> GGUF (spec.tensor_type) -> layer package, written atomically."""
  layout = StageLayout.whole(cfg, mtp=True)
  leaves = loading.flat_paths(state)
  transposed = loading.linear_weight_paths(state)
  tensors = {}
  for name in tiny_glm.build_tiny_glm_tensors(spec):
    path = registry.tensor_targets(name, cfg, layout)[0].path
    array = np.asarray(leaves[path], np.float32)
    tensors[name] = np.ascontiguousarray(array.T) if path in transposed else array
  work = pathlib.Path(tempfile.mkdtemp(prefix="train-demo-"))
  try:
    gguf_path = work / "glm-demo.gguf"
    tiny_glm.write_glm_gguf(gguf_path, spec, tensors, tokenizer_meta, model_name="mtpjax-glm-demo")
    package = work / "package"
    split_gguf(gguf_path, package, model_id=f"mtpjax/glm-demo:{spec.tensor_type}")
    (package / "MODEL_CARD.md").write_text(model_card(card))
    if out_dir.exists():
      shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(package), str(out_dir))
  finally:
    shutil.rmtree(work, ignore_errors=True)


def _figures(values) -> str:
  return ", ".join(f"{v:.3f}" for v in values)


def model_card(card: dict) -> str:
  m = card["metrics"]
  return f"""# mtpjax GLM demo model

A {card['parameters'] / 1e6:.1f}M-parameter GLM-4.x MoE (llama.cpp arch `glm4moe`) with one
NextN (MTP) block, trained by `tools/train_demo.py` on the interpreter's standard-library
sources ({card['corpus_files']} files, {card['train_tokens']} training tokens, held-out every
20th file). Stored as {card['flags']['tensor_type']} in a v1 layer package.

Reproduce: `python tools/train_demo.py {' '.join(f'--{k}={v}' for k, v in card['flags'].items())}`

| held-out metric | value |
|---|---|
| trunk cross-entropy | {m['ce_trunk']:.3f} |
| MTP cross-entropy | {m['ce_mtp']:.3f} |
| MTP/trunk argmax agreement (greedy acceptance proxy) | {m['mtp_agreement']:.3f} |
| per draft depth 1..D: MTP cross-entropy | {_figures(m['ce_mtp_by_depth'])} |
| per draft depth 1..D: argmax agreement (teacher-forced) | {_figures(m['mtp_agreement_by_depth'])} |

Training took {card['train_seconds']:.0f} s. Full record:

```json
{json.dumps(card, indent=1, sort_keys=True)}
```
"""


def main(argv):
  del argv
  flag_values = {k: FLAGS[k].value for k in ("steps", "batch", "seq_len", "lr", "mtp_weight",
                                                 "vocab", "hidden", "layers", "experts",
                                                 "expert_ffn", "seed", "tensor_type",
                                                 "corpus_files")}
  depth_weights = tuple(float(w) for w in FLAGS.mtp_depth_weights)
  if len(depth_weights) > 1:   # one entry keeps the shipped model's reproduce line unchanged
    flag_values["mtp_depth_weights"] = ",".join(FLAGS.mtp_depth_weights)
  train_texts, held_out = split_corpus(FLAGS.corpus_files)
  tokenizer_meta = train_tokenizer(train_texts, FLAGS.vocab)
  tokenizer = GgufTokenizer.from_metadata(tokenizer_meta)
  eos = tokenizer.special_ids["eos"]
  encode = lambda docs: np.concatenate([np.asarray(tokenizer.encode(d) + [eos], np.int32)
                                        for d in docs])
  train_ids, eval_ids = encode(train_texts), encode(held_out)

  spec = model_spec(len(tokenizer_meta["tokenizer.ggml.tokens"]))
  cfg = model_config(spec)
  graphdef, state = init_params(cfg, StageLayout.whole(cfg, mtp=True), FLAGS.seed)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
  schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, min(100, FLAGS.steps // 10),
                                                FLAGS.steps, FLAGS.lr * 0.05)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, weight_decay=0.01))
  opt_state = optimizer.init(state)

  @jax.jit
  def train_step(state, opt_state, tokens):
    (loss, aux), grads = jax.value_and_grad(losses, argnums=1, has_aux=True)(
        graphdef, state, tokens, FLAGS.mtp_weight, depth_weights)
    updates, opt_state = optimizer.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss, aux

  evaluate = jax.jit(lambda state, tokens: losses(graphdef, state, tokens, FLAGS.mtp_weight,
                                                  depth_weights)[1])
  data = batches(train_ids, FLAGS.batch, FLAGS.seq_len, np.random.default_rng(FLAGS.seed))
  start = time.time()
  for step in range(1, FLAGS.steps + 1):
    state, opt_state, loss, (ce_trunk, ce_mtp, agree) = train_step(state, opt_state, next(data))
    if step % 50 == 0 or step == 1:
      print(json.dumps({"step": step, "loss": float(loss), "ce_trunk": float(ce_trunk),
                        "ce_mtp": np.asarray(ce_mtp).tolist(),
                        "agree": np.asarray(agree).tolist(),
                        "elapsed_s": round(time.time() - start, 1)}), flush=True)
  train_seconds = time.time() - start

  eval_data = batches(eval_ids, FLAGS.batch, FLAGS.seq_len, np.random.default_rng(12345))
  evals = [jax.tree.map(np.asarray, evaluate(state, next(eval_data)))
           for _ in range(FLAGS.eval_batches)]
  metrics = [np.mean([e[i] for e in evals], axis=0) for i in range(3)]
  card = {"flags": flag_values, "parameters": n_params,
          "corpus_files": len(train_texts) + len(held_out),
          "train_tokens": int(train_ids.size), "held_out_tokens": int(eval_ids.size),
          "train_seconds": round(train_seconds, 1), "python": os.sys.version.split()[0],
          "metrics": {"ce_trunk": float(metrics[0]), "ce_mtp": float(metrics[1][0]),
                      "mtp_agreement": float(metrics[2][0]),
                      "ce_mtp_by_depth": metrics[1].tolist(),
                      "mtp_agreement_by_depth": metrics[2].tolist()}}
  export(graphdef, state, spec, cfg, tokenizer_meta, pathlib.Path(FLAGS.out), card)
  print(json.dumps(card), flush=True)


if __name__ == "__main__":
  app.run(main)
