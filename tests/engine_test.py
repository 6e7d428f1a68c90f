"""Tests for mtpjax.engine.engine: the jitted prefill / insert / decode and verify+draft steps.

References are independent of the engine: the llama.cpp-converted fixture with transformers'
greedy continuation, full-sequence forwards (`Model.logits`, `model.forward` over the whole
committed sequence with a fresh cache) and from-scratch MTP passes (`model.mtp_rows`).
"""

import functools
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import mtpjax
from mtpjax.engine.contract import ACCEPTED, COUNT, TOKEN_A, TOKEN_B, committed_tokens, warm_up
from mtpjax.engine.drafting_policy import AdaptiveDrafting
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.state import CATCH_UP_ROWS
from mtpjax.models.interface import stage_forward
from mtpjax.models.registry import init_cache as init_kv
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf
from fixtures import FIXTURES

FIXTURE = FIXTURES / "glm4moe-tiny"
FIXTURE_F32 = FIXTURE / "glm4moe_h64-F32.gguf"
ATOL = 1e-5


def load_generated(tmp: str, spec: TinyGlmSpec):
  path = write_tiny_glm_gguf(Path(tmp) / f"tiny-{spec.seed}.gguf", spec)[0]
  return mtpjax.load(str(path))


@functools.partial(jax.jit, static_argnums=0)
def cached_forward(graphdef, params, tokens, positions, kv):
  """Trunk pass over `tokens` at `positions` on top of `kv`: logits, hiddens, new cache."""
  model = nnx.merge(graphdef, params)
  hidden, kv, _ = stage_forward(model, tokens, positions, kv)
  return model.lm_logits(hidden), hidden, kv


@functools.partial(jax.jit, static_argnums=0)
def scratch_passes(graphdef, params, tokens):
  """From scratch over one padded sequence: trunk hiddens and KV, then the MTP KV and logits.

  MTP row q is (x_q, h_{q-1}) at position q with a zero hidden for row 0 (docs/DECODE.md §3).
  """
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  length = tokens.shape[1]
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  hidden, kv, _ = stage_forward(model, tokens, positions,
                                init_kv(cfg, cfg.n_layers, 1, length, jnp.float32))
  prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
  z, _, mtp_kv = model.mtp_rows(tokens, prev, positions,
                                init_kv(cfg, 1, 1, length, jnp.float32)[0])
  return hidden, kv, mtp_kv, model.mtp_logits(z)


@functools.partial(jax.jit, static_argnums=0)
def scratch_mtp_rows(graphdef, params, tokens, prev):
  """The NextN block from scratch over one padded sequence of MTP rows (token, hidden): draft
  logits and the block's output before its head norm (what a draft chain feeds back)."""
  model = nnx.merge(graphdef, params)
  length = tokens.shape[1]
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  z, y, _ = model.mtp_rows(tokens, prev, positions,
                           init_kv(model.cfg, 1, 1, length, jnp.float32)[0])
  return model.mtp_logits(z), y


def slot_caches(state, stage: int = 0, pools=None) -> list:
  """A stage's page pools (or `pools`, GQA pairs) read through the page tables as per-slot
  caches, k [slots, Hkv, S, hd] and v [slots, Hkv, vd, S] (rows past a slot's pages read as
  some page's: stale)."""
  pages = np.minimum(state.pages.table, state.pages.pages - 1)
  seq = lambda pool, axes: np.asarray(pool)[pages].transpose(axes)
  caches = []
  for k, v in state.kv[stage] if pools is None else pools:
    k, v = seq(k, (0, 2, 1, 3, 4)), seq(v, (0, 2, 3, 1, 4))
    caches.append((k.reshape(k.shape[:2] + (-1, k.shape[-1])), v.reshape(v.shape[:3] + (-1,))))
  return caches


def view(state):
  """(slots, trunk caches per slot, MTP cache per slot) of a one-stage, one-group state."""
  mtp = slot_caches(state, pools=[state.mtp.kv])[0] if state.mtp is not None else None
  return state.groups[0].head.slots, slot_caches(state), mtp


class FixtureTest(parameterized.TestCase):
  """The llama.cpp-converted fixture against transformers' greedy continuation."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = mtpjax.load(str(FIXTURE_F32))
    cls.ref = np.load(FIXTURE / "hf_ref.npz")

  @parameterized.parameters("disabled", "native-mtp-n1")
  def test_greedy_matches_transformers(self, strategy):
    result = self.model.generate(self.ref["prompt_ids"], max_new_tokens=32,
                                 speculative=strategy, adaptive_drafting=False)
    self.assertEqual(result.tokens, self.ref["greedy_ids"].tolist())
    self.assertEqual(result.finish_reason, "length")
    self.assertEqual(result.stats.native_mtp, strategy != "disabled")
    self.assertEqual(result.stats.drafted, 32 if strategy != "disabled" else 0)

  def test_adaptive_drafting_pauses_a_rejected_head_and_keeps_tokens(self):
    """The fixture's random head is always rejected: each window of drafts is followed by a
    pause of `cooldown` steps, doubled after every failing window."""
    result = self.model.generate(self.ref["prompt_ids"], max_new_tokens=32,
                                 speculative="native-mtp-n1")
    self.assertEqual(result.tokens, self.ref["greedy_ids"].tolist())
    policy = AdaptiveDrafting()
    step, pause, expected = 0, policy.cooldown, 0
    while step < 31:                       # the steps after the prefill's pass
      drafts = min(policy.window, 31 - step)
      expected += drafts
      step += drafts + pause
      pause = min(2 * pause, policy.cooldown * policy.max_backoff)
    self.assertEqual(expected, 2 * policy.window)   # window, pause, window, longer pause
    self.assertEqual(result.stats.verifications, expected)
    self.assertEqual(result.stats.pending, 0)
    self.assertEqual(result.stats.target_passes, 32)

  def test_warm_up_compiles_everything_requests_need(self):
    """After warm_up, prompts in both buckets and paused drafting trigger no compile."""
    engine = self.model.engine(native_mtp=True, slots=3, max_len=64, prefill_buckets=(16, 32),
                               decode_steps=1)    # single steps (bursts: overlapped_steps_test)
    warm_up(engine)
    traces = dict(engine.trace_counts)
    self.assertEqual(engine.slot_buckets, (1, 2, 3))   # each step over 1, 2 or 3 slots
    # Each prefill bucket with and without the NextN rows; the step of detached slots alone
    # (`Engine.detach`) is the MTP-off step, once per slot bucket.
    self.assertEqual(traces, {"prefill": 4, "insert": 1, "verify_draft": 3, "plain": 3,
                              "catch_up": 3, "decode": 3})
    prompts = [self.ref["prompt_ids"], np.arange(20, dtype=np.int32)]
    results = SlotScheduler(engine).run([Request(prompt=p, max_new_tokens=30) for p in prompts])
    self.assertLess(results[0].stats.verifications, 29)     # the random head got paused
    self.assertEqual(engine.trace_counts, traces)

  def test_timing_mode_keeps_tokens_and_fills_durations(self):
    result = self.model.generate(self.ref["prompt_ids"], max_new_tokens=12,
                                 speculative="native-mtp-n1", timing=True,
                                 adaptive_drafting=False)
    self.assertEqual(result.tokens, self.ref["greedy_ids"][:12].tolist())
    self.assertGreater(result.stats.proposal_compute_us, 0)
    self.assertGreater(result.stats.verification_compute_us, 0)
    # The engine `generate` built: one slot, no prefix cache, no logprobs.
    engine = self.model.engine(native_mtp=True, slots=1, max_len=128, timing=True,
                               prefix_cache=0, logprobs=0)
    self.assertEqual(engine.trace_counts, {"prefill": 1, "insert": 1, "verify": 1, "draft": 1})


class ForwardEquivalenceTest(absltest.TestCase):
  """Cached step-by-step logits equal the full forward's (flax gemma test_forward_equivalence)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.model = load_generated(cls.tmp.name, TinyGlmSpec(seed=3))
    cls.graphdef, cls.params = cls.model.weights(with_mtp=False)

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_plain_decode_and_verify_positions(self):
    """Two slots at different positions; plain steps, accepted and rejected verify passes."""
    cfg = self.model.config
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, cfg.vocab_size, size=(2, 30)).astype(np.int32)
    full = np.stack([self.model.logits(s) for s in seqs])                     # [2, 30, V]
    kv = init_kv(cfg, cfg.n_layers, 2, 40, jnp.float32)
    pos = np.array([5, 11])
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 16)).astype(np.int32)  # padding garbage
    for s in range(2):
      tokens[s, :pos[s]] = seqs[s, :pos[s]]
    logits, _, kv = cached_forward(self.graphdef, self.params, jnp.asarray(tokens),
                                   jnp.arange(16, dtype=jnp.int32)[None].repeat(2, 0), kv)
    for s in range(2):
      np.testing.assert_allclose(logits[s, :pos[s]], full[s, :pos[s]], atol=ATOL, rtol=ATOL)
    ops = ["decode", "accept", "reject", "accept", "decode", "reject", "reject", "accept"] * 3
    checked = {"decode": 0, "accept": 0, "reject": 0}
    for op in ops:
      if pos.max() + 2 > seqs.shape[1]:
        break
      rows = np.arange(2)
      if op == "decode":
        step_tokens = seqs[rows, pos][:, None]
      else:
        second = seqs[rows, pos + 1] if op == "accept" else (seqs[rows, pos + 1] + 1) % 7
        step_tokens = np.stack([seqs[rows, pos], second], axis=1)
      positions = pos[:, None] + np.arange(step_tokens.shape[1])[None]
      logits, _, kv = cached_forward(self.graphdef, self.params, jnp.asarray(step_tokens),
                                     jnp.asarray(positions, jnp.int32), kv)
      logits = np.asarray(logits)
      for s in range(2):
        np.testing.assert_allclose(logits[s, 0], full[s, pos[s]], atol=ATOL, rtol=ATOL,
                                   err_msg=f"{op} slot {s} position {pos[s]}")
        if op == "accept":
          np.testing.assert_allclose(logits[s, 1], full[s, pos[s] + 1], atol=ATOL, rtol=ATOL,
                                     err_msg=f"verify second row, slot {s}")
      checked[op] += 1
      pos = pos + (2 if op == "accept" else 1)
    self.assertTrue(all(n >= 2 for n in checked.values()), checked)


class MtpEngineTest(parameterized.TestCase):
  """The MTP engine on a generated model with a random NextN block (its hidden input matters)."""

  MAX_LEN = 64

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.model = load_generated(cls.tmp.name, TinyGlmSpec(seed=5))
    kwargs = dict(slots=2, max_len=cls.MAX_LEN, prefill_buckets=(16, 32))
    cls.on = cls.model.engine(native_mtp=True, **kwargs)
    cls.off = cls.model.engine(native_mtp=False, **kwargs)
    cls.graphdef, cls.params = cls.model.weights(with_mtp=True)
    rng = np.random.default_rng(1)
    cls.prompts = [rng.integers(0, 500, size=n).astype(np.int32) for n in (7, 12)]
    requests = [Request(prompt=p, max_new_tokens=40) for p in cls.prompts]
    cls.reference = [r.tokens for r in SlotScheduler(cls.off).run(requests)]

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def check_state_against_scratch(self, engine_state, slot: int, committed: list[int],
                                  check_draft: bool = True):
    """pos/current/h_prev/draft and the KV rows a query can see, against from-scratch passes.

    A slot whose MTP KV lags (paused drafting) is checked up to its last caught-up MTP row.
    """
    state, kv_cached, mtp_cached = view(engine_state)
    pos = int(state.pos[slot])
    mtp_rows = pos + 1 - int(state.mtp_lag[slot])
    self.assertEqual(len(committed), pos + 1, "pos must index the last committed token")
    self.assertEqual(int(state.current[slot]), committed[-1])
    padded = np.zeros((1, self.MAX_LEN), np.int32)
    padded[0, :pos + 1] = committed
    hidden, kv, mtp_kv, mtp_logits = scratch_passes(self.graphdef, self.params,
                                                    jnp.asarray(padded))
    np.testing.assert_allclose(state.h_prev[slot], hidden[0, pos - 1], atol=ATOL, rtol=ATOL)
    # Caches are k [B, Hkv, S, hd] and v [B, Hkv, vd, S]: rows sit on axis 2 and 3.
    k_rows = lambda cache, b, n: np.asarray(cache)[b, :, :n]
    v_rows = lambda cache, b, n: np.asarray(cache)[b, ..., :n]
    for layer, (k, v) in enumerate(kv):
      for name, rows, cached, fresh in (("k", k_rows, kv_cached[layer][0], k),
                                        ("v", v_rows, kv_cached[layer][1], v)):
        np.testing.assert_allclose(
            rows(cached, slot, pos), rows(fresh, 0, pos), atol=ATOL, rtol=ATOL,
            err_msg=f"target {name} layer {layer} rows 0..{pos - 1}")
    for name, rows, cached, fresh in (("k", k_rows, mtp_cached[0], mtp_kv[0]),
                                      ("v", v_rows, mtp_cached[1], mtp_kv[1])):
      np.testing.assert_allclose(rows(cached, slot, mtp_rows), rows(fresh, 0, mtp_rows),
                                 atol=ATOL, rtol=ATOL, err_msg=f"MTP {name} rows 0..{mtp_rows}")
    if check_draft:
      self.assertEqual(int(state.draft[slot, 0]), int(np.argmax(mtp_logits[0, pos])))

  def scratch_chain(self, committed: list[int], depth: int) -> list[int]:
    """The draft chain after `committed`, each draft from a fresh NextN pass over the whole
    sequence whose rows past the last committed one are (draft, the previous row's y)."""
    pos = len(committed) - 1
    tokens = np.zeros((1, self.MAX_LEN), np.int32)
    tokens[0, :pos + 1] = committed
    hidden = np.asarray(scratch_passes(self.graphdef, self.params, jnp.asarray(tokens))[0])
    prev = np.zeros_like(hidden)
    prev[0, 1:pos + 1] = hidden[0, :pos]
    chain = []
    for i in range(depth):
      logits, y = scratch_mtp_rows(self.graphdef, self.params, jnp.asarray(tokens),
                                   jnp.asarray(prev))
      chain.append(int(np.argmax(logits[0, pos + i])))
      tokens[0, pos + i + 1] = chain[-1]
      prev[0, pos + i + 1] = y[0, pos + i]
    return chain

  def test_multi_token_chains_keep_output_and_caches(self):
    """Windows of 3 (slot 0) and 2 (slot 1, padded into the same step) with 0..window right
    drafts injected: the committed tokens, the trunk and MTP caches and the whole next chain
    match from-scratch passes, after accepted and rejected chains alike."""
    engine = self.model.engine(native_mtp=True, slots=2, max_len=self.MAX_LEN,
                               prefill_buckets=(16, 32), draft_tokens=3)
    state, emitted = self.prefill_both(engine)
    windows = np.array([3, 2], np.int32)
    for step in range(7):
      right = [(step + slot) % 4 for slot in range(2)]
      group = state.groups[0]
      drafts = np.asarray(group.head.slots.draft).copy()
      for slot in range(2):
        target = self.reference[slot][len(emitted[slot]):][:3]
        drafts[slot] = [t if i < right[slot] else (t + 1) % 500 for i, t in enumerate(target)]
      group.head = group.head.replace(slots=group.head.slots.replace(
          draft=jax.device_put(drafts, group.head.slots.draft.sharding)))
      state, result, _ = engine.step(state, np.ones(2, bool), windows)
      for slot in range(2):
        accepted = min(right[slot], windows[slot])     # a window caps what it accepts
        self.assertEqual((result[slot][COUNT], result[slot][ACCEPTED]), (accepted + 1, accepted))
        emitted[slot] += committed_tokens(result[slot])
        committed = list(self.prompts[slot]) + emitted[slot]
        self.check_state_against_scratch(state, slot, committed)
        self.assertEqual(np.asarray(view(state)[0].draft[slot]).tolist(),
                         self.scratch_chain(committed, 3), f"step {step} slot {slot}")
    for slot in range(2):
      self.assertEqual(emitted[slot], self.reference[slot][:len(emitted[slot])])

  def prefill_both(self, engine):
    """Both prompts prefilled into slots 0 and 1: (state, tokens emitted per slot)."""
    state = engine.init_state()
    emitted = [[], []]
    for slot, prompt in enumerate(self.prompts):
      prefix = engine.prefill(prompt, SamplerParams(), state=state)
      state = engine.insert(prefix, state, slot)
      emitted[slot].append(int(prefix.current[0]))
    return state, emitted

  def test_forced_rejections_keep_output_and_mtp_kv(self):
    """Drafts injected into the state: wrong ones (rejected), right ones (accepted), natural."""
    engine = self.on
    state, emitted = self.prefill_both(engine)
    active = np.ones(2, bool)
    outcomes = {"reject": 0, "accept": 0}
    for step in range(14):
      kinds = [("reject", "accept", "natural")[(step + slot) % 3] for slot in range(2)]
      group = state.groups[0]
      drafts = np.asarray(group.head.slots.draft).copy()
      for slot, kind in enumerate(kinds):
        target = self.reference[slot][len(emitted[slot])]   # the token t_a will be
        if kind != "natural":
          drafts[slot, 0] = target if kind == "accept" else (target + 1) % 500
      # Placed as the state's own arrays are, so the step sees the shapes and shardings it
      # was compiled for.
      drafts = jax.device_put(drafts, group.head.slots.draft.sharding)
      group.head = group.head.replace(slots=group.head.slots.replace(draft=drafts))
      state, result, _ = engine.step(state, active)
      for slot, kind in enumerate(kinds):
        row = result[slot]
        if kind != "natural":
          self.assertEqual(row[ACCEPTED], int(kind == "accept"))
          self.assertEqual(row[COUNT], 2 if kind == "accept" else 1)
          outcomes[kind] += 1
        emitted[slot] += [int(row[TOKEN_A])] + ([int(row[TOKEN_B])] if row[COUNT] == 2 else [])
        self.check_state_against_scratch(state, slot, list(self.prompts[slot]) + emitted[slot])
    for slot in range(2):
      self.assertEqual(emitted[slot], self.reference[slot][:len(emitted[slot])])
    self.assertEqual(outcomes, {"reject": 9, "accept": 10})

  def test_paused_steps_skip_the_mtp_block_and_catch_up_before_drafting(self):
    """Steps without drafting run no MTP block (the MTP KV falls behind by one row a step);
    the next drafting step first catches the rows up, so drafting resumes with exactly the
    state a never-paused run has. 20 paused steps need two catch-up passes."""
    engine = self.on
    warm_up(engine)      # every variant compiled, whichever tests ran before
    state, emitted = self.prefill_both(engine)
    active = np.ones(2, bool)
    paused = 20
    self.assertGreater(paused, CATCH_UP_ROWS)
    schedule = [(False, False)] * paused + [(True, False)] * 3 + [(True, True)] * 3
    for step, drafting in enumerate(schedule):
      traces = dict(engine.trace_counts)
      catch_ups = traces.get("catch_up", 0)
      state, result, _ = engine.step(state, active, np.asarray(drafting))
      # The state's host copy of the lag (no read-back before a catch-up) is the device's.
      device_lag = np.asarray(view(state)[0].mtp_lag)
      np.testing.assert_array_equal(state.mtp_lag[0], device_lag)
      if not any(drafting):
        self.assertEqual(engine.trace_counts.get("verify_draft"), traces.get("verify_draft"))
        self.assertEqual(device_lag.tolist(), [step + 1] * 2)
      else:
        self.assertEqual(device_lag.tolist(), [0, 0])
      for slot in range(2):
        row = result[slot]
        if not drafting[slot]:
          self.assertEqual((row[COUNT], row[ACCEPTED]), (1, 0))
        emitted[slot] += [int(row[TOKEN_A])] + ([int(row[TOKEN_B])] if row[COUNT] == 2 else [])
        self.check_state_against_scratch(state, slot, list(self.prompts[slot]) + emitted[slot],
                                         check_draft=any(drafting))
      self.assertEqual(engine.trace_counts.get("catch_up", 0), catch_ups)   # compiled once
    for slot in range(2):
      self.assertEqual(emitted[slot], self.reference[slot][:len(emitted[slot])])

  def paused_steps(self, engine, steps: int):
    """Both prompts prefilled, then `steps` steps without drafting: (state, tokens per slot)."""
    state, emitted = self.prefill_both(engine)
    for _ in range(steps):
      state, result, _ = engine.step(state, np.ones(2, bool), np.zeros(2, bool))
      for slot in range(2):
        emitted[slot].append(int(result[slot][TOKEN_A]))
    return state, emitted

  def test_catch_up_restores_the_draft_and_mtp_rows(self):
    engine = self.on
    state, emitted = self.paused_steps(engine, 5)
    active = np.ones(2, bool)
    state = engine.catch_up(state, active)
    self.assertEqual(np.asarray(view(state)[0].mtp_lag).tolist(), [0, 0])
    self.assertEqual(state.mtp_lag[0].tolist(), [0, 0])
    for slot in range(2):
      self.check_state_against_scratch(state, slot, list(self.prompts[slot]) + emitted[slot])

  def test_prefill_state_matches_scratch(self):
    state = self.on.init_state()
    prefix = self.on.prefill(self.prompts[1], SamplerParams(), state=state)
    state = self.on.insert(prefix, state, 1)
    committed = list(self.prompts[1]) + [self.reference[1][0]]
    self.check_state_against_scratch(state, 1, committed)

  @parameterized.parameters(True, False)
  def test_one_trace_per_bucket_and_one_step(self, native_mtp):
    """Prompts in both buckets, greedy and sampled, twice: the class engine never retraces."""
    engine = self.on if native_mtp else self.off
    rng = np.random.default_rng(2)
    for round_ in range(2):
      requests = [Request(prompt=rng.integers(0, 500, size=n).astype(np.int32),
                          max_new_tokens=int(m), sampler=SamplerParams(t, k, p, seed=n))
                  for n, m, t, k, p in ((3, 5, 0.0, 0, 1.0), (20, 9, 0.7, 5, 1.0),
                                        (9, 4, 1.0, 0, 0.8), (25, 7, 0.0, 0, 1.0),
                                        (14, 6, 1.5, 3, 0.5))]
      results = SlotScheduler(engine).run(requests)
      self.assertEqual([len(r.tokens) for r in results], [5, 9, 4, 7, 6])
      step = "verify_draft" if native_mtp else "decode"
      counts = dict(engine.trace_counts)
      # Once per bucket, with native MTP once more per bucket without the NextN rows (a
      # request the cost policy's pause outlasts, `Engine.detach`).
      self.assertLessEqual(counts["prefill"], 4 if native_mtp else 2, f"round {round_}")
      self.assertGreaterEqual(counts["prefill"], 2, f"round {round_}")
      self.assertEqual(counts["insert"], 1, f"round {round_}")
      # At most once per slot bucket; other tests of the class may have compiled the
      # paused-drafting and detached steps, once per bucket too.
      for name in (step, "plain", "catch_up", "decode"):
        self.assertLessEqual(counts.get(name, 0), len(engine.slot_buckets), name)
      if round_:
        self.assertEqual(counts, first_round)
      first_round = counts

  def test_a_step_runs_over_the_first_slots_only(self):
    """With only slot 0 active a step computes one slot of two (`Engine.slots_for`), and the
    slot's state still matches from-scratch passes through drafting, paused and caught-up
    steps; the result rows past the step's slots are zero."""
    engine = self.on
    warm_up(engine)
    state = engine.init_state()
    prefix = engine.prefill(self.prompts[0], SamplerParams(), state=state)
    state = engine.insert(prefix, state, 0)
    emitted = [int(prefix.current[0])]
    active = np.array([True, False])
    self.assertEqual(engine.slots_for(active), 1)
    self.assertEqual(engine.slots_for(np.array([False, True])), 2)
    traces = dict(engine.trace_counts)
    for drafting in [True] * 3 + [False] * 5 + [True] * 3:
      state, result, _ = engine.step(state, active, np.full(2, drafting))
      row = result[0]
      emitted += [int(row[TOKEN_A])] + ([int(row[TOKEN_B])] if row[COUNT] == 2 else [])
      np.testing.assert_array_equal(result[1], 0)
      self.check_state_against_scratch(state, 0, list(self.prompts[0]) + emitted,
                                       check_draft=drafting)
    self.assertEqual(emitted, self.reference[0][:len(emitted)])
    self.assertEqual(engine.trace_counts, traces)    # warm_up compiled the one-slot steps

  @parameterized.parameters((False, "decode", 1), (True, "plain", 1), (True, "verify_draft", 1),
                            (False, "decode", 2), (True, "verify_draft", 2))
  def test_one_slot_steps_write_their_caches_in_place(self, native_mtp, step, slots):
    """No compiled one-slot step copies a whole KV cache, in a one-slot engine or over the
    first of two slots. With one slot XLA:CPU used to copy every per-slot cache four times
    per decode or plain step, and the donated NextN pools once paired with the trunk's."""
    engine = self.model.engine(native_mtp=native_mtp, slots=slots, max_len=self.MAX_LEN,
                               prefill_buckets=(16,))
    state = engine.init_state()
    group = state.groups[0]
    active = np.ones(1, bool)
    fns = engine._draft_steps[1] if step == "verify_draft" else engine._steps[step]
    hlo = fns[0].lower(engine._leaves[0], None, state.kv[0], state.pages.table[:1],
                       state.joined(group),
                       active, active.astype(np.int32) if native_mtp else None,
                       None, np.bool_(False)).compile().as_text()
    copied = {tuple(int(d) for d in dims.split(",") if d)
              for dims in re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", hlo)}
    caches = jax.tree.leaves((state.kv, state.mtp))
    self.assertFalse(copied & {tuple(c.shape) for c in caches}, f"cache copies in {step}")

  def test_donation_deletes_the_input_state(self):
    engine = self.on
    state = engine.init_state()
    group = state.groups[0]
    before_prefill, before_insert = state.kv[0][0][0], group.head.slots.pos
    prefix = engine.prefill(self.prompts[0], SamplerParams(), state=state)
    self.assertTrue(before_prefill.is_deleted())       # prefilled into the pool in place
    state = engine.insert(prefix, state, 0)
    self.assertTrue(before_insert.is_deleted())
    self.assertFalse(prefix.head.slots.pos.is_deleted())   # the prefix is read, not donated
    trunk, mtp = state.kv[0][-1][1], state.mtp.kv[0]
    state, _, _ = engine.step(state, np.array([True, False]))
    self.assertTrue(trunk.is_deleted())
    self.assertTrue(mtp.is_deleted())
    self.assertFalse(state.kv[0][-1][1].is_deleted())


if __name__ == "__main__":
  absltest.main()
