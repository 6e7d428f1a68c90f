"""Tests for mtpjax.testing.tiny_glm: tiny GLM-4.x MoE GGUFs written with the real gguf writer.

Names, key set and layouts are checked against the llama.cpp-converted glm4moe-tiny fixture,
and the model's behaviour (routing margins, MTP-copies-trunk drafts) against a plain numpy
forward written here from docs/MODEL.md §6-§7, independent of any mtpjax model code.
"""

import tempfile
from pathlib import Path

import gguf
import numpy as np
from absl.testing import absltest, parameterized
from gguf.constants import GGMLQuantizationType as T

from mtpjax.testing import tiny_glm
from mtpjax.testing.tiny_glm import TinyGlmSpec
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moe-tiny"
FIXTURE_F32 = FIXTURE / "glm4moe_h64-F32.gguf"


# ---------------------------------------------------------------------------------------------
# Plain numpy reference forward (float64), docs/MODEL.md §6-§7.


def _rms(x, w, eps):
  return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope_neox(x, pos, rot, theta):
  half = rot // 2
  ang = pos[:, None] * theta ** (-2.0 * np.arange(half) / rot)
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  x1, x2 = x[..., :half], x[..., half:rot]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], axis=-1)


def _attention(t, p, spec, a, pos):
  n_tok, hd = a.shape[0], spec.head_dim

  def proj(kind, heads):
    y = a @ t[f"{p}attn_{kind}.weight"].T
    if f"{p}attn_{kind}.bias" in t:
      y = y + t[f"{p}attn_{kind}.bias"]
    return y.reshape(n_tok, heads, hd)

  q, k, v = proj("q", spec.n_heads), proj("k", spec.n_kv_heads), proj("v", spec.n_kv_heads)
  if f"{p}attn_q_norm.weight" in t:
    q = _rms(q, t[f"{p}attn_q_norm.weight"], spec.eps)
    k = _rms(k, t[f"{p}attn_k_norm.weight"], spec.eps)
  q = _rope_neox(q, pos, spec.rope_dims, spec.rope_theta)
  k = _rope_neox(k, pos, spec.rope_dims, spec.rope_theta)
  rep = spec.n_heads // spec.n_kv_heads
  k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
  scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
  scores = np.where(np.tril(np.ones((n_tok, n_tok), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  o = np.einsum("hts,shd->thd", probs, v).reshape(n_tok, -1)
  return o @ t[f"{p}attn_output.weight"].T


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _moe(t, p, spec, m, margins):
  """Routed + shared experts; appends each token's smallest selection margin to `margins`."""
  s = 1.0 / (1.0 + np.exp(-(m @ t[f"{p}ffn_gate_inp.weight"].T)))
  sel = s + t[f"{p}exp_probs_b.bias"]
  group_size = spec.n_experts // spec.n_groups
  out = np.zeros_like(m)
  for i in range(m.shape[0]):
    row = sel[i].copy()
    margin = np.inf
    if spec.n_groups > 1:
      g_score = np.sort(row.reshape(spec.n_groups, group_size), axis=-1)[:, -2:].sum(-1)
      order = np.argsort(-g_score)
      margin = g_score[order[spec.groups_used - 1]] - g_score[order[spec.groups_used]]
      for g in order[spec.groups_used:]:
        row[g * group_size:(g + 1) * group_size] = -np.inf
    order = np.argsort(-row)
    idx = order[:spec.n_experts_used]
    if np.isfinite(row[order[spec.n_experts_used]]):
      margin = min(margin, row[idx[-1]] - row[order[spec.n_experts_used]])
    margins.append((margin, tuple(sorted(idx))))
    w = s[i, idx]
    if spec.norm_topk:
      w = w / w.sum()
    w = w * spec.routed_scale
    for wk, e in zip(w, idx):
      g = m[i] @ t[f"{p}ffn_gate_exps.weight"][e].T
      u = m[i] @ t[f"{p}ffn_up_exps.weight"][e].T
      out[i] += wk * ((_silu(g) * u) @ t[f"{p}ffn_down_exps.weight"][e].T)
  if f"{p}ffn_gate_shexp.weight" in t:
    g, u = m @ t[f"{p}ffn_gate_shexp.weight"].T, m @ t[f"{p}ffn_up_shexp.weight"].T
    out += (_silu(g) * u) @ t[f"{p}ffn_down_shexp.weight"].T
  return out


def _block(t, i, spec, x, pos, margins):
  p = f"blk.{i}."
  x = x + _attention(t, p, spec, _rms(x, t[p + "attn_norm.weight"], spec.eps), pos)
  m = _rms(x, t[p + "post_attention_norm.weight"], spec.eps)
  if f"{p}ffn_gate.weight" in t:
    ffn = (_silu(m @ t[p + "ffn_gate.weight"].T) * (m @ t[p + "ffn_up.weight"].T)) @ t[
        p + "ffn_down.weight"].T
  else:
    ffn = _moe(t, p, spec, m, margins)
  return x + ffn


def _head(t):
  return t.get("output.weight", t["token_embd.weight"])


def numpy_forward(t, spec, ids):
  """Trunk logits [T, V], post-norm hidden h [T, D], router margins (margin, experts)."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  pos = np.arange(len(ids), dtype=np.float64)
  x, margins = t["token_embd.weight"][ids], []
  for i in range(spec.n_trunk_layers):
    x = _block(t, i, spec, x, pos, margins)
  h = _rms(x, t["output_norm.weight"], spec.eps)
  return h @ _head(t).T, h, margins


def numpy_mtp(t, spec, ids, h):
  """Draft logits: row p pairs token ids[p] with h[p-1] (zero hidden for row 0)."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  L, p = spec.n_trunk_layers, f"blk.{spec.n_trunk_layers}.nextn."
  emb = t.get(p + "embed_tokens.weight", t["token_embd.weight"])[ids]
  prev = np.concatenate([np.zeros_like(h[:1]), h[:-1]], axis=0)
  u = np.concatenate([_rms(emb, t[p + "enorm.weight"], spec.eps),
                      _rms(prev, t[p + "hnorm.weight"], spec.eps)], axis=-1)
  u = u @ t[p + "eh_proj.weight"].T
  y = _block(t, L, spec, u, np.arange(len(ids), dtype=np.float64), [])
  z = _rms(y, t.get(p + "shared_head_norm.weight", t["output_norm.weight"]), spec.eps)
  return z @ t.get(p + "shared_head_head.weight", _head(t)).T


def _reader_contents(reader):
  return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tempdir(test):
  """A fresh folder removed after the test (create_tempdir needs absl flags, absent in pytest)."""
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return Path(tmp.name)


# ---------------------------------------------------------------------------------------------


class TinyGlmFileTest(parameterized.TestCase):
  """The default spec against the llama.cpp-converted fixture, through real files."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.paths = tiny_glm.write_tiny_glm_gguf(Path(cls.tmp.name) / "tiny.gguf")
    cls.reader = gguf.GGUFReader(cls.paths[0])
    cls.fixture = gguf.GGUFReader(FIXTURE_F32)

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_single_file_named_as_asked(self):
    self.assertEqual([p.name for p in self.paths], ["tiny.gguf"])
    self.assertEqual([p.name for p in Path(self.tmp.name).iterdir()], ["tiny.gguf"])

  def test_keys_match_fixture_in_order_types_and_values(self):
    ours, theirs = self.reader.fields, self.fixture.fields
    self.assertEqual(list(ours), list(theirs))
    for key in theirs:
      self.assertEqual(ours[key].types, theirs[key].types, key)
    ours_c, theirs_c = _reader_contents(self.reader), _reader_contents(self.fixture)
    # Everything but the name and the learned vocabulary equals the fixture (the same spec).
    skip = {"general.name", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"}
    for key in theirs_c:
      if key not in skip:
        self.assertEqual(ours_c[key], theirs_c[key], key)
    self.assertEqual(ours_c["glm4moe.block_count"], 4)
    self.assertEqual(ours_c["glm4moe.nextn_predict_layers"], 1)
    self.assertEqual(ours_c["glm4moe.expert_gating_func"], 2)
    self.assertEqual(ours_c["general.size_label"], "8x270K")

  def test_tensor_names_types_shapes_match_fixture(self):
    ours = [(t.name, t.tensor_type, [int(d) for d in t.shape]) for t in self.reader.tensors]
    theirs = [(t.name, t.tensor_type, [int(d) for d in t.shape]) for t in self.fixture.tensors]
    self.assertEqual(ours, theirs)

  def test_tensor_data_round_trips(self):
    master = tiny_glm.build_tiny_glm_tensors(TinyGlmSpec())
    self.assertEqual(list(master), [t.name for t in self.reader.tensors])
    for t in self.reader.tensors:
      self.assertEqual(t.data.dtype, np.float32)
      np.testing.assert_array_equal(np.asarray(t.data), master[t.name], err_msg=t.name)

  def test_tokenizer_metadata_is_what_was_written(self):
    meta = tiny_glm.tiny_tokenizer_metadata(512)
    ours = _reader_contents(self.reader)
    for key, value in meta.items():
      self.assertEqual(ours[key], value, key)

  def test_tokenizer_vocab_is_consistent_byte_level_bpe(self):
    meta = tiny_glm.tiny_tokenizer_metadata(512)
    tokens, types, merges = (meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"],
                             meta["tokenizer.ggml.merges"])
    self.assertLen(tokens, 512)
    self.assertLen(set(tokens), 512)
    # Same byte alphabet, in the same order, as the fixture's HF-trained vocab.
    self.assertEqual(tokens[:256], self.fixture.fields["tokenizer.ggml.tokens"].contents()[:256])
    self.assertGreaterEqual(len(merges), 1)
    known = set(tokens[:256])
    for k, merge in enumerate(merges):
      left, right = merge.split(" ")
      self.assertIn(left, known, merge)
      self.assertIn(right, known, merge)
      self.assertEqual(tokens[256 + k], left + right)
      known.add(left + right)
    specials = {tok: i for i, tok in enumerate(tokens) if types[i] == 3}
    fixture_ids = {"<|endoftext|>": 502, "[MASK]": 503, "[gMASK]": 504, "[sMASK]": 505,
                   "<sop>": 506, "<eop>": 507, "<|system|>": 508, "<|user|>": 509,
                   "<|assistant|>": 510, "<|observation|>": 511}  # special_ids.json
    self.assertEqual(specials, fixture_ids)
    self.assertEqual(meta["tokenizer.ggml.bos_token_id"], 504)
    self.assertEqual(meta["tokenizer.ggml.eot_token_id"], 509)
    self.assertEqual(meta["tokenizer.ggml.eom_token_id"], 511)
    self.assertEqual(meta["tokenizer.ggml.eos_token_id"], 502)

  def test_tokenizer_pads_when_corpus_runs_out_and_rejects_tiny_vocab(self):
    meta = tiny_glm.tiny_tokenizer_metadata(4096)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    self.assertLen(tokens, 4096)
    n_merges = len(meta["tokenizer.ggml.merges"])
    self.assertEqual(tokens[256 + n_merges], f"[PAD{256 + n_merges}]")
    self.assertEqual(types[256 + n_merges], 5)  # UNUSED, as llama.cpp's converter pads
    self.assertEqual(tokens[-10:], list(tiny_glm.SPECIAL_TOKENS))
    with self.assertRaises(ValueError):
      tiny_glm.tiny_tokenizer_metadata(200)


class TinyGlmSpecVariantsTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.tmp = _tempdir(self)

  def test_deterministic_per_seed(self):
    a = tiny_glm.build_tiny_glm_tensors(TinyGlmSpec(seed=3))
    b = tiny_glm.build_tiny_glm_tensors(TinyGlmSpec(seed=3))
    c = tiny_glm.build_tiny_glm_tensors(TinyGlmSpec(seed=4))
    self.assertEqual(list(a), list(b))
    for name in a:
      np.testing.assert_array_equal(a[name], b[name])
    self.assertFalse(np.array_equal(a["blk.1.ffn_gate_inp.weight"], c["blk.1.ffn_gate_inp.weight"]))
    pa = tiny_glm.write_tiny_glm_gguf(self.tmp / "a.gguf", TinyGlmSpec(seed=3))[0]
    pb = tiny_glm.write_tiny_glm_gguf(self.tmp / "b.gguf", TinyGlmSpec(seed=3))[0]
    self.assertEqual(pa.read_bytes(), pb.read_bytes())

  def test_optional_tensors_follow_flags(self):
    spec = TinyGlmSpec(attn_bias=False, qk_norm=False, tied_head=True, nextn_embed=True,
                       nextn_head=False, nextn_head_norm=False, n_shared_experts=0)
    names = set(tiny_glm.build_tiny_glm_tensors(spec))
    self.assertNotIn("output.weight", names)
    self.assertFalse(any(n.endswith((".bias",)) and "attn_" in n for n in names))
    self.assertFalse(any("_norm" in n and "attn_q" in n for n in names))
    self.assertFalse(any("shexp" in n for n in names))
    self.assertIn("blk.3.nextn.embed_tokens.weight", names)
    self.assertNotIn("blk.3.nextn.shared_head_head.weight", names)
    self.assertNotIn("blk.3.nextn.shared_head_norm.weight", names)
    # Values depend on (seed, name) only: shared tensors are unchanged by the flags.
    base = tiny_glm.build_tiny_glm_tensors(TinyGlmSpec())
    full = tiny_glm.build_tiny_glm_tensors(spec)
    np.testing.assert_array_equal(full["blk.2.attn_q.weight"], base["blk.2.attn_q.weight"])

  def test_trunk_only_has_no_nextn_key_or_block(self):
    path = tiny_glm.write_tiny_glm_gguf(self.tmp / "t.gguf", TinyGlmSpec(mtp=False))[0]
    reader = gguf.GGUFReader(path)
    self.assertEqual(reader.fields["glm4moe.block_count"].contents(), 3)
    self.assertNotIn("glm4moe.nextn_predict_layers", reader.fields)
    self.assertFalse(any(t.name.startswith("blk.3.") for t in reader.tensors))

  def test_keys_follow_spec(self):
    spec = TinyGlmSpec(hidden=96, n_heads=6, n_kv_heads=3, head_dim=16, n_trunk_layers=4,
                       leading_dense=2, n_experts=12, n_experts_used=3, n_groups=3,
                       groups_used=2, rope_dims=8, rope_theta=5e5, eps=1e-6,
                       routed_scale=1.8, norm_topk=False, context_length=1024, vocab_size=300)
    reader = gguf.GGUFReader(tiny_glm.write_tiny_glm_gguf(self.tmp / "k.gguf", spec)[0])
    c = _reader_contents(reader)
    expected = {
        "glm4moe.block_count": 5, "glm4moe.nextn_predict_layers": 1,
        "glm4moe.embedding_length": 96, "glm4moe.attention.head_count": 6,
        "glm4moe.attention.head_count_kv": 3, "glm4moe.attention.key_length": 16,
        "glm4moe.attention.value_length": 16, "glm4moe.leading_dense_block_count": 2,
        "glm4moe.expert_count": 12, "glm4moe.expert_used_count": 3,
        "glm4moe.expert_group_count": 3, "glm4moe.expert_group_used_count": 2,
        "glm4moe.rope.dimension_count": 8, "glm4moe.context_length": 1024,
        "glm4moe.expert_weights_norm": False, "glm4moe.expert_gating_func": 2,
    }
    for key, value in expected.items():
      self.assertEqual(c[key], value, key)
    self.assertAlmostEqual(c["glm4moe.rope.freq_base"], 5e5)
    self.assertAlmostEqual(c["glm4moe.attention.layer_norm_rms_epsilon"], 1e-6, places=10)
    self.assertAlmostEqual(c["glm4moe.expert_weights_scale"], 1.8, places=6)
    self.assertLen(c["tokenizer.ggml.tokens"], 300)
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    self.assertEqual(shapes["token_embd.weight"], [96, 300])
    self.assertEqual(shapes["blk.1.ffn_up.weight"], [96, 128])
    self.assertEqual(shapes["blk.2.ffn_down_exps.weight"], [32, 96, 12])
    self.assertEqual(shapes["blk.4.attn_q.weight"], [96, 96])
    self.assertEqual(shapes["blk.4.attn_k_norm.weight"], [16])
    self.assertEqual(shapes["blk.4.nextn.eh_proj.weight"], [192, 96])

  def test_split_shards_names_and_tensor_union(self):
    paths = tiny_glm.write_tiny_glm_gguf(self.tmp / "s.gguf", split_max_tensors=30)
    self.assertEqual([p.name for p in paths],
                     [f"s-0000{i}-of-00003.gguf" for i in (1, 2, 3)])
    self.assertEqual(sorted(p.name for p in self.tmp.iterdir()), [p.name for p in paths])
    readers = [gguf.GGUFReader(p) for p in paths]
    names = [t.name for r in readers for t in r.tensors]
    master = tiny_glm.build_tiny_glm_tensors(TinyGlmSpec())
    self.assertEqual(names, list(master))
    self.assertEqual([len(r.tensors) for r in readers], [30, 30, 19])
    for i, r in enumerate(readers):
      self.assertEqual(r.fields["split.no"].contents(), i)
      self.assertEqual(r.fields["split.count"].contents(), 3)
      self.assertEqual(r.fields["split.tensors.count"].contents(), 79)
      for t in r.tensors:
        np.testing.assert_array_equal(np.asarray(t.data), master[t.name])
    self.assertIn("tokenizer.ggml.tokens", readers[0].fields)
    self.assertNotIn("glm4moe.block_count", readers[1].fields)

  def test_failed_write_leaves_nothing(self):
    with self.assertRaises(ValueError):
      tiny_glm.write_tiny_glm_gguf(self.tmp / "bad.gguf", TinyGlmSpec(tensor_type="Q7_X"))
    self.assertEqual(list(self.tmp.iterdir()), [])

  @parameterized.parameters(
      dict(spec=dict(n_heads=3, n_kv_heads=2)), dict(spec=dict(rope_dims=33)),
      dict(spec=dict(n_groups=3)), dict(spec=dict(n_experts_used=5)),
      dict(spec=dict(mtp=False, mtp_copies_trunk=True)), dict(spec=dict(vocab_size=100)))
  def test_invalid_specs_rejected(self, spec):
    with self.assertRaises(ValueError):
      tiny_glm.build_tiny_glm_tensors(TinyGlmSpec(**spec))


class TinyGlmTensorTypesTest(parameterized.TestCase):

  @parameterized.parameters("F16", "BF16", "Q8_0", "Q4_0", "Q5_1")
  def test_types_as_requested_and_values_as_stored(self, tensor_type):
    spec = TinyGlmSpec(tensor_type=tensor_type)
    tmp = _tempdir(self)
    reader = gguf.GGUFReader(tiny_glm.write_tiny_glm_gguf(tmp / "q.gguf", spec)[0])
    want = T[tensor_type]
    stored = tiny_glm.stored_tiny_glm_tensors(spec)
    master = tiny_glm.build_tiny_glm_tensors(spec)
    self.assertEqual(reader.fields["general.file_type"].contents(),
                     int(tiny_glm._FILE_TYPES[tensor_type]))
    for t in reader.tensors:
      n_dims = len(t.shape)
      if n_dims == 1 or t.name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
        self.assertEqual(t.tensor_type, T.F32, t.name)
      else:
        self.assertEqual(t.tensor_type, want, t.name)
      values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(master[t.name].shape)
      np.testing.assert_array_equal(values, stored[t.name], err_msg=t.name)
      # Stored values approximate the master weights (to the type's precision).
      scale = np.abs(master[t.name]).max()
      tol = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.15, "Q5_1": 0.08}[tensor_type]
      np.testing.assert_allclose(values, master[t.name], atol=tol * scale, err_msg=t.name)

  @parameterized.parameters("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
  def test_kquant_falls_back_to_q8_0_on_short_rows(self, tensor_type):
    spec = TinyGlmSpec(hidden=256, ffn=256, expert_ffn=64, n_heads=2, n_kv_heads=1,
                       head_dim=128, rope_dims=64, vocab_size=300, tensor_type=tensor_type)
    tmp = _tempdir(self)
    reader = gguf.GGUFReader(tiny_glm.write_tiny_glm_gguf(tmp / "k.gguf", spec)[0])
    master = tiny_glm.build_tiny_glm_tensors(spec)
    stored = tiny_glm.stored_tiny_glm_tensors(spec)
    want, seen = T[tensor_type], set()
    for t in reader.tensors:
      ne0 = int(t.shape[0])
      if len(t.shape) == 1 or t.name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
        expected = T.F32
      elif ne0 % 256 == 0:
        expected = want
      else:
        expected = T.Q8_0
      self.assertEqual(t.tensor_type, expected, t.name)
      seen.add(t.tensor_type)
      values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(master[t.name].shape)
      np.testing.assert_array_equal(values, stored[t.name], err_msg=t.name)
      self.assertTrue(np.isfinite(values).all(), t.name)
      if expected == want:
        # Random blocks, but matched to the master's scale and centred.
        ratio = values.std() / master[t.name].std()
        self.assertBetween(ratio, 0.8, 1.25, t.name)
        self.assertLess(abs(values.mean()), 0.1 * values.std(), t.name)
    self.assertEqual(seen, {T.F32, T.Q8_0, want})  # ffn_down_exps rows are 64 -> Q8_0

  def test_kquant_mtp_copies_trunk_keeps_identity_zeros_and_copies(self):
    spec = TinyGlmSpec(hidden=256, ffn=256, expert_ffn=64, n_heads=2, n_kv_heads=1,
                       head_dim=128, rope_dims=64, vocab_size=300, tensor_type="Q4_K",
                       mtp_copies_trunk=True, nextn_embed=True)
    self.assertEqual(tiny_glm.tensor_type_for(spec, "blk.3.nextn.eh_proj.weight", (256, 512)),
                     T.Q8_0)
    self.assertEqual(tiny_glm.tensor_type_for(spec, "output.weight", (300, 256)), T.Q4_K)
    stored = tiny_glm.stored_tiny_glm_tensors(spec)
    self.assertEqual(np.abs(stored["blk.3.attn_output.weight"]).max(), 0.0)
    np.testing.assert_array_equal(stored["blk.3.nextn.shared_head_head.weight"],
                                  stored["output.weight"])
    np.testing.assert_array_equal(stored["blk.3.nextn.embed_tokens.weight"],
                                  stored["token_embd.weight"])
    eh = stored["blk.3.nextn.eh_proj.weight"]
    np.testing.assert_allclose(eh[:, :256], np.eye(256), atol=1e-3)
    self.assertEqual(np.abs(eh[:, 256:]).max(), 0.0)


class TinyGlmBehaviourTest(absltest.TestCase):
  """The synthetic weights behave as the brief requires, per an independent numpy forward."""

  IDS = np.random.default_rng(123).integers(0, 502, size=24)

  def test_router_choices_are_well_separated_and_varied(self):
    spec = TinyGlmSpec()
    _, _, margins = numpy_forward(tiny_glm.build_tiny_glm_tensors(spec), spec, self.IDS)
    self.assertLen(margins, 24 * 2)  # 2 MoE trunk layers
    smallest = min(m for m, _ in margins)
    self.assertGreater(smallest, 2e-3)
    self.assertGreaterEqual(len({experts for _, experts in margins}), 4)

  def test_logits_have_clear_argmax(self):
    spec = TinyGlmSpec()
    logits, _, _ = numpy_forward(tiny_glm.build_tiny_glm_tensors(spec), spec, self.IDS)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    self.assertGreater(np.median(top2[:, 1] - top2[:, 0]), 0.1)
    self.assertGreater(logits.std(), 1.0)

  def test_mtp_copies_trunk_draft_matches_trunk_argmax(self):
    for spec in (TinyGlmSpec(mtp_copies_trunk=True),
                 TinyGlmSpec(mtp_copies_trunk=True, tied_head=False, nextn_embed=True, seed=7)):
      t = tiny_glm.build_tiny_glm_tensors(spec)
      logits, h, _ = numpy_forward(t, spec, self.IDS)
      draft = numpy_mtp(t, spec, self.IDS, h)
      agree = np.mean(draft.argmax(-1) == logits.argmax(-1))
      self.assertGreaterEqual(agree, 0.9, spec)
      # The trunk still mixes context: its logits are not exactly the token-only ones.
      self.assertGreater(np.abs(draft - logits).max(), 1e-3)

  def test_random_mtp_head_does_not_copy_trunk(self):
    spec = TinyGlmSpec()
    t = tiny_glm.build_tiny_glm_tensors(spec)
    logits, h, _ = numpy_forward(t, spec, self.IDS)
    draft = numpy_mtp(t, spec, self.IDS, h)
    self.assertLess(np.mean(draft.argmax(-1) == logits.argmax(-1)), 0.5)

  def test_mtp_copies_trunk_file_keeps_structure_under_q8_0(self):
    spec = TinyGlmSpec(mtp_copies_trunk=True, tensor_type="Q8_0")
    stored = tiny_glm.stored_tiny_glm_tensors(spec)
    self.assertEqual(np.abs(stored["blk.3.attn_output.weight"]).max(), 0.0)
    np.testing.assert_array_equal(stored["blk.3.nextn.shared_head_head.weight"],
                                  stored["output.weight"])
    logits, h, _ = numpy_forward(stored, spec, self.IDS)
    draft = numpy_mtp(stored, spec, self.IDS, h)
    self.assertGreaterEqual(np.mean(draft.argmax(-1) == logits.argmax(-1)), 0.9)


if __name__ == "__main__":
  absltest.main()
