"""Chunked prefill: a prompt longer than the largest bucket, prefilled chunk after chunk, the
scheduler's steps between a long prompt's chunks, and prefix caching.

References are independent of the engine's chunking: `Model.logits` / `Model.mtp_logits` (one
full forward over the whole sequence), and each request decoded alone.
"""

import pathlib
import tempfile

import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import mtpjax
from mtpjax import errors
from mtpjax.engine.contract import EngineConfig
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf
from mtpjax.testing.tiny_mla import TinyDsaSpec, write_tiny_dsa_gguf
from fixtures import FIXTURES

MAX_LEN = 80
BUCKETS = (16,)          # every prompt past 15 tokens takes several chunks
NEW_TOKENS = 10
ATOL = 2e-4


def _write_model(kind: str, tmp: str) -> str:
  if kind == "glm4moe":
    return str(write_tiny_glm_gguf(pathlib.Path(tmp) / "glm.gguf", TinyGlmSpec(seed=5))[0])
  if kind == "glm-dsa":     # index_topk 4, far below the prompts: the sparse path runs
    path = pathlib.Path(tmp) / "dsa.gguf"
    write_tiny_dsa_gguf(path, TinyDsaSpec(mtp=True, seed=2))
    return str(path)
  return str(FIXTURES / "glm4moelite-tiny" / "glm4moelite_h64-F32.gguf")   # deepseek2 MLA


def check_prefix(test, model, engine, prompt, state):
  """The prefix's last hidden gives the full forward's logits, and its draft is the
  from-scratch MTP pass's argmax at the first sampled token's row."""
  prefix = engine.prefill(prompt, SamplerParams(), state=state)
  graphdef, params = model.weights(with_mtp=True)
  head = nnx.merge(graphdef, params)
  logits = np.asarray(head.lm_logits(prefix.head.slots.h_prev))[0]
  np.testing.assert_allclose(logits, model.logits(prompt)[-1], atol=ATOL, rtol=ATOL)
  first = int(prefix.current[0])
  mtp_logits = model.mtp_logits(np.append(prompt, first))
  test.assertEqual(int(prefix.head.slots.draft[0, 0]), int(np.argmax(mtp_logits[-1])))


def cached_tokens(engine, state, prompt) -> int:
  """Prompt tokens a prefill of `prompt` would take from `state`'s prefix cache."""
  job = engine.start_prefill(prompt, SamplerParams(), state=state)
  engine.drop_prefill(job)
  return job.cached


class ChunkPlanTest(absltest.TestCase):

  def test_chunks_cover_the_prompt_and_leave_the_mtp_row(self):
    cfg = EngineConfig(max_len=100, prefill_buckets=(16, 32))
    cases = {31: [(0, 31, 32)], 32: [(0, 31, 32), (31, 1, 16)],
             70: [(0, 32, 32), (32, 32, 32), (64, 6, 16)]}
    for n, want in cases.items():
      self.assertEqual(cfg.prefill_chunks(np.ones(n, np.int32))[1], want, n)

  def test_a_prompt_past_the_context_is_refused(self):
    cfg = EngineConfig(max_len=100, prefill_buckets=(16, 32))
    with self.assertRaises(errors.ContextLengthError) as caught:
      cfg.prefill_chunks(np.ones(100, np.int32))
    self.assertEqual(caught.exception.field, "prompt")


class ChunkedPrefillTest(parameterized.TestCase):
  """Each architecture: cached decode after a multi-chunk prefill equals a full forward."""

  def run_case(self, kind: str):
    with tempfile.TemporaryDirectory() as tmp:
      model = mtpjax.load(_write_model(kind, tmp))
      cfg = model.config
      rng = np.random.default_rng(7)
      prompts = [rng.integers(0, cfg.vocab_size, size=n).astype(np.int32) for n in (45, 32)]
      requests = [Request(prompt=prompts[0], max_new_tokens=NEW_TOKENS),
                  Request(prompt=prompts[1], max_new_tokens=NEW_TOKENS,
                          sampler=SamplerParams(temperature=0.9, seed=3))]
      outputs = {}
      for mtp in (False, True):
        engine = model.engine(native_mtp=mtp, slots=1, max_len=MAX_LEN, prefill_buckets=BUCKETS)
        # Drafting at every step: one step kind to compile.
        outputs[mtp] = [r.tokens for r in SlotScheduler(engine, adaptive=None).run(requests)]
        self.assertEqual(engine.trace_counts["prefill"], 1)   # one bucket, every chunk
        if mtp:
          check_prefix(self, model, engine, prompts[0], engine.init_state())
      self.assertEqual(outputs[True], outputs[False], "MTP on and off differ (greedy, sampled)")
      tokens = outputs[False][0]
      sequence = np.concatenate([prompts[0], tokens[:-1]])
      reference = np.argmax(model.logits(sequence), axis=-1)[len(prompts[0]) - 1:]
      self.assertEqual(tokens, reference.tolist(), "greedy tokens vs a full forward")

  @parameterized.parameters("glm4moe", "deepseek2", "glm-dsa")
  def test_matches_full_forward(self, kind):
    self.run_case(kind)


class PrefixCacheTest(absltest.TestCase):
  """A prompt sharing whole pages with an earlier one prefills only the rest, and decodes as a
  full forward over it (native MTP on: the NextN block's cache follows the reused pages)."""

  def test_reused_prefix_gives_the_cold_tokens(self):
    with tempfile.TemporaryDirectory() as tmp:
      model = mtpjax.load(_write_model("glm4moe", tmp))
    rng = np.random.default_rng(4)
    first = rng.integers(0, 500, size=45).astype(np.int32)        # caches its first 32 tokens
    second = np.concatenate([first[:40], rng.integers(0, 500, size=10).astype(np.int32)])
    engine = model.engine(native_mtp=True, slots=1, max_len=MAX_LEN, prefill_buckets=BUCKETS,
                          prefix_cache=2)
    scheduler = SlotScheduler(engine, adaptive=None)
    self.assertEqual(cached_tokens(engine, scheduler.state, second), 0)
    scheduler.run([Request(prompt=first, max_new_tokens=2)])
    self.assertEqual(cached_tokens(engine, scheduler.state, second), 32)
    tokens = scheduler.run([Request(prompt=second, max_new_tokens=NEW_TOKENS)])[0].tokens
    sequence = np.concatenate([second, tokens[:-1]])
    reference = np.argmax(model.logits(sequence), axis=-1)[len(second) - 1:]
    self.assertEqual(tokens, reference.tolist())
    self.assertEqual(cached_tokens(engine, scheduler.state, second), 48)
    check_prefix(self, model, engine, second, scheduler.state)   # from the 48 cached tokens on


class InterleavingTest(absltest.TestCase):
  """Decode steps of live slots run between a long prompt's chunks."""

  def test_live_slots_decode_between_chunks(self):
    with tempfile.TemporaryDirectory() as tmp:
      model = mtpjax.load(_write_model("glm4moe", tmp))
    rng = np.random.default_rng(1)
    short = rng.integers(0, 500, size=5).astype(np.int32)
    long = rng.integers(0, 500, size=70).astype(np.int32)       # 5 chunks of 16
    engine = model.engine(native_mtp=False, slots=2, max_len=MAX_LEN, prefill_buckets=BUCKETS)
    alone = [SlotScheduler(engine).run([Request(prompt=p, max_new_tokens=NEW_TOKENS)])[0].tokens
             for p in (short, long)]
    events = []
    requests = [Request(prompt=p, max_new_tokens=NEW_TOKENS,
                        on_tokens=lambda t, name=name: events.append(name))
                for name, p in (("short", short), ("long", long))]
    for interleave in (True, False):
      events.clear()
      results = SlotScheduler(engine, interleave_prefill=interleave).run(requests)
      self.assertEqual([r.tokens for r in results], alone)
      before_long = events.index("long")
      # Interleaved, the short stream's first token and a step per chunk of the long prompt's
      # prefill; with steps overlapped (MTP off) the step beside the last chunk is still in
      # flight when the long prompt's first token is handed out. Without interleaving the
      # short stream waits for the whole prefill after its first token.
      self.assertTrue(engine.overlapping)
      self.assertEqual(before_long, 4 if interleave else 1)


if __name__ == "__main__":
  absltest.main()
