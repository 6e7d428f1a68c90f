"""Train the offline demo model: a small GLM-4.x MoE with a real NextN (MTP) head.

    python -m tools.train_demo --out=mtpjax/assets/glm-demo   # the shipped model (defaults)

Deterministic for a given seed and interpreter: the corpus is the running interpreter's own
standard-library sources (no download), excluding tests and generated tables. The loss is
`CE_trunk + mtp_weight * sum_d w_d CE_mtp_d` with the MTP row convention of docs/MODEL.md §7 (row p
pairs x_p with the trunk hidden h_{p-1}, zero for row 0, and predicts x_{p+1}). Depth d > 1
(`--mtp_depth_weights`, one weight per depth) trains the recursive draft chain the engine runs:
the same block over rows pairing x_p with its own depth d - 1 output y_{p-1} (before the head
norm, as the chain feeds it back), teacher-forced with the true tokens. The forward is
`mtpjax.models` itself; only the optimiser loop and the export live here. The result is written
with mtpjax's GGUF writer in llama.cpp's `glm4moe` layout, then split into a layer package
whose native-MTP strategy advertises `--window_policy`, with a MODEL_CARD.md holding the flags,
the held-out training metrics, and what the exported package does when it decodes held-out
prompts: the accept rate per draft depth and tokens per target pass at windows 1..3 (greedy,
drafting every step), beside llama.cpp's `draft-mtp` accept rate on the same prompts' text and
GGUF (`--llama_speculative`).
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
import mtpjax
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtpjax import loading
from mtpjax.gguf.tokenizer import GgufTokenizer, glm_pre_tokenizer
from mtpjax.draft_window import DraftWindow
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.engine.steps import fresh_forward, fresh_mtp_rows
from mtpjax.models.config import ModelConfig
from mtpjax.models import registry
from mtpjax.models.interface import StageLayout, previous_hidden
from mtpjax.package.writer import check_window_policy, parse_window_policy, split_gguf
from mtpjax.telemetry import MtpStats
from mtpjax.testing import tiny_glm
from mtpjax.testing.corpus import held_out_prompts, split_corpus
from tools import llama_cpp

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "mtpjax/assets/glm-demo", "package directory to write")
flags.DEFINE_integer("steps", 800, "optimizer steps")
flags.DEFINE_integer("batch", 16, "sequences per step")
flags.DEFINE_integer("seq_len", 128, "tokens per training sequence")
flags.DEFINE_float("lr", 3e-3, "peak learning rate")
flags.DEFINE_float("mtp_weight", 0.3, "weight of the MTP cross-entropy")
flags.DEFINE_list("mtp_depth_weights", ["1", "0.6", "0.4"], "per draft depth 1..D, its share "
                  "of mtp_weight (one entry: a single-token head)")
flags.DEFINE_integer("vocab", 4096, "byte-level BPE vocabulary size (GLM specials included)")
flags.DEFINE_integer("hidden", 256, "model width")
flags.DEFINE_integer("layers", 4, "trunk layers (layer 0 dense, MoE after)")
flags.DEFINE_integer("experts", 8, "routed experts")
flags.DEFINE_integer("expert_ffn", 128, "per-expert FFN width")
flags.DEFINE_integer("seed", 0, "seed for data order and initialisation")
flags.DEFINE_integer("eval_batches", 8, "held-out batches for the metrics")
flags.DEFINE_string("tensor_type", "Q8_0", "GGUF storage type of the weight matrices")
flags.DEFINE_integer("corpus_files", 0, "use only the first N corpus files (0: all)")
flags.DEFINE_string("window_policy", "adaptive:1:2:3", "the package's native-MTP draft window, "
                    "DEFAULT:MIN:INITIAL:MAX; more than one token is declared as strategy `mtp`")
flags.DEFINE_string("llama_speculative", "", "llama.cpp's llama-speculative-simple: state its "
                    "draft-mtp accept rate on the exported GGUF in the card (empty: not run)")
flags.DEFINE_list("card_windows", ["1", "2", "3"], "draft windows the card's held-out decode "
                  "figures are measured at")
flags.DEFINE_integer("card_new_tokens", 128, "tokens each card prompt decodes")

CARD_PROMPTS, CARD_PROMPT_LEN = 8, 64     # held-out prompts (seed 0) the card decodes

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


def decode_figures(package: pathlib.Path, prompts: list[list[int]]) -> dict:
  """Per card window k: accept rate per draft depth, overall, and tokens per target pass of
  the package decoding the prompts greedily, drafting k tokens at every step."""
  model = mtpjax.load(str(package))
  requests = [Request(prompt=np.asarray(p, np.int32), max_new_tokens=FLAGS.card_new_tokens,
                      sampler=SamplerParams(0.0, 0, 1.0, seed=i)) for i, p in enumerate(prompts)]
  figures = {}
  for k in map(int, FLAGS.card_windows):
    engine = model.engine(native_mtp=True, draft_tokens=k, slots=len(prompts),
                          max_len=CARD_PROMPT_LEN + FLAGS.card_new_tokens + 1)
    results = SlotScheduler(engine, adaptive=None, window=DraftWindow.fixed(k)).run(requests)
    stats = MtpStats.total(r.stats for r in results)
    figures[str(k)] = {"accept_rate": stats.accept_rate,
                       "accept_rate_by_depth": stats.accept_rate_by_position,
                       "tokens_per_target_pass": stats.tokens_per_target_pass}
  return figures


def llama_cpp_figures(binary: str, gguf_path: pathlib.Path, texts: list[str]) -> dict:
  """Per card window k: llama.cpp's `draft-mtp` accept rate (accepted / drafted, summed over
  the card's prompts as text, each run greedily on one thread)."""
  figures = {}
  with tempfile.TemporaryDirectory() as tmp:
    for k in map(int, FLAGS.card_windows):
      drafted = accepted = 0
      for i, text in enumerate(texts):
        prompt = pathlib.Path(tmp) / f"prompt-{i}.txt"
        prompt.write_text(text)
        counts = llama_cpp.parse_speculative(llama_cpp.run(
            binary, "-m", str(gguf_path), "-f", str(prompt), "-n", str(FLAGS.card_new_tokens),
            "--spec-type", "draft-mtp", "--spec-draft-n-max", str(k), "--temp", "0",
            "--top-k", "1", "-t", "1", "--seed", str(i), "-c", "1024", stream="stderr"))
        drafted += counts["n_drafted"]
        accepted += counts["n_accept"]
      figures[str(k)] = {"accept_rate": accepted / drafted if drafted else 0.0,
                         "drafted": drafted, "accepted": accepted}
  return figures


def export(graphdef, state, spec, cfg, tokenizer_meta, window: dict, out_dir: pathlib.Path,
           card: dict):
  """Float32 params -> GGUF (spec.tensor_type) -> layer package advertising `window`, measured
  for the card on held-out prompts, then renamed into place."""
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
    split_gguf(gguf_path, package, model_id=f"mtpjax/glm-demo:{spec.tensor_type}",
               generation_format="native-mtp-n1" if window["max_window"] == 1 else "mtp",
               window_policy=window)
    card["window_policy"] = window
    tokenizer = GgufTokenizer.from_metadata(tokenizer_meta)
    prompts = held_out_prompts(tokenizer.encode, CARD_PROMPTS, CARD_PROMPT_LEN, seed=0)
    card["decode"] = decode_figures(package, prompts)
    if FLAGS.llama_speculative:
      try:
        card["llama_cpp_draft_mtp"] = llama_cpp_figures(
            FLAGS.llama_speculative, gguf_path, [tokenizer.decode(p) for p in prompts])
      except (OSError, RuntimeError, ValueError) as error:   # the trained model is kept
        card["llama_cpp_draft_mtp_error"] = str(error)[-500:]
    (package / "MODEL_CARD.md").write_text(model_card(card))
    if out_dir.exists():
      shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(package), str(out_dir))
  finally:
    shutil.rmtree(work, ignore_errors=True)


def _figures(values) -> str:
  return ", ".join(f"{v:.3f}" for v in values)


def decode_table(card: dict) -> str:
  """The card's held-out decoding section: ours per window, llama.cpp's beside it when run."""
  window = card["window_policy"]
  llama = card.get("llama_cpp_draft_mtp", {})
  llama_missing = "failed (see the record)" if "llama_cpp_draft_mtp_error" in card else "not run"
  rows = "\n".join(
      f"| {k} | {_figures(f['accept_rate_by_depth'])} | {f['accept_rate']:.3f} | "
      f"{f['tokens_per_target_pass']:.2f} | "
      f"{format(llama[k]['accept_rate'], '.3f') if k in llama else llama_missing} |"
      for k, f in card["decode"].items())
  return f"""The package's native-MTP strategy advertises the draft window `{window['default']}`
{window['min_window']}..{window['max_window']} tokens (initial {window['initial_window']}).
Decoding {CARD_PROMPTS} held-out prompts of {CARD_PROMPT_LEN} tokens, {FLAGS.card_new_tokens} new
tokens each, greedy, drafting every step at a fixed window (llama.cpp: `llama-speculative-simple
--spec-type draft-mtp --spec-draft-n-max K --temp 0 --top-k 1` on the same GGUF and the same
prompts as text; accept rate = accepted / drafted):

| window | mtpjax accept rate per depth 1..K | mtpjax accept rate | tokens per target pass | llama.cpp accept rate |
|---|---|---|---|---|
{rows}
"""


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

{decode_table(card)}
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
                                                 "corpus_files", "window_policy")}
  window = check_window_policy(parse_window_policy(FLAGS.window_policy))   # before training
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
  export(graphdef, state, spec, cfg, tokenizer_meta, window, pathlib.Path(FLAGS.out), card)
  print(json.dumps(card), flush=True)


if __name__ == "__main__":
  app.run(main)
