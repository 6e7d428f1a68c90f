"""The paged KV cache: the allocator against hand-computed tables, paged attention against the
per-slot layout, and engines over a pool smaller than slots x max_len against full forwards
and each request decoded alone (glm4moe, deepseek2 MLA, glm-dsa with index_topk below the
prompts), with MTP on and off, greedy and sampled, and prefix pages shared; bfloat16 pools held
as their bits, and bfloat16 and float16 KV caches for a float32 model."""

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from mtpjax import errors
from mtpjax.engine.contract import committed_tokens, warm_up
from mtpjax.engine.page_pool import PageList, PagePool
from mtpjax.engine.prefix_cache import PrefixCache
from mtpjax.engine.sampling import SamplerParams
from mtpjax.engine.scheduler import Request, SlotScheduler
from mtpjax.engine.state import CATCH_UP_ROWS
from mtpjax.models import blockwise, kv_cache
from chunked_prefill_test import _write_model, check_prefix

MAX_LEN = 80
BUCKETS = (16,)            # prompts past 15 tokens take several chunks; pages of 16 rows
POOL = 10                  # pages per pool: 4 slots at full context would take 4 x 6
NEW_TOKENS = 6


class PagePoolTest(absltest.TestCase):
  """Pages of 4 rows, tables of 3, a pool of 6 pages (ids 0..5; 6 means none)."""

  def test_grow_assign_and_free_give_the_hand_computed_tables(self):
    pool = PagePool(pages=6, page_rows=4, max_pages=3, slots=2)
    first, second = PageList(), PageList()
    self.assertTrue(pool.reserve(first, 3))
    self.assertEqual((pool.available, pool.free_pages), (3, 6))
    pool.grow(first, 5)                                 # rows 0..4: two pages
    np.testing.assert_array_equal(pool.row(first), [0, 1, 6])
    self.assertEqual((first.reserved, pool.available), (1, 3))
    self.assertFalse(pool.reserve(second, 4))           # 3 left unpromised
    self.assertTrue(pool.reserve(second, 3))
    pool.assign(1, first)
    pool.grow_slot(1, 12)                               # the third page, from the reservation
    pool.grow(second, 1)
    np.testing.assert_array_equal(pool.table, [[6, 6, 6], [0, 1, 2]])
    np.testing.assert_array_equal(pool.row(second), [3, 6, 6])
    pool.free_slot(1)
    np.testing.assert_array_equal(pool.table[1], [6, 6, 6])
    self.assertEqual((pool.free_pages, pool.available), (5, 3))
    pool.grow(second, 12)                               # the lowest free pages first
    np.testing.assert_array_equal(pool.row(second), [3, 0, 1])
    pool.release(second)
    self.assertEqual((pool.free_pages, pool.reserved), (6, 0))
    np.testing.assert_array_equal(pool.refs, 0)

  def test_growth_past_the_pool_is_a_typed_error(self):
    pool = PagePool(pages=2, page_rows=4, max_pages=3, slots=1)
    with self.assertRaises(errors.KvPagesError) as caught:
      pool.grow(PageList(), 12)
    self.assertEqual(caught.exception.field, "engine.kv_pages")

  def test_prefix_pages_are_shared_and_reclaimed_when_unused(self):
    pool = PagePool(pages=4, page_rows=4, max_pages=4, slots=1)
    cache = PrefixCache(page=4, capacity=4, pool=pool)
    writer = PageList()
    pool.grow(writer, 8)
    cache.store(b"prefix", writer.pages, before=None)
    np.testing.assert_array_equal(pool.refs, [2, 2, 0, 0])
    pool.release(writer)
    reader = PageList()
    pages, _ = cache.longest([(8, b"prefix")])[1]
    pool.share(reader, pages)
    self.assertFalse(pool.reserve(PageList(), 3))       # the entry's pages are in use
    pool.release(reader)
    self.assertEqual(pool.free_pages, 2)
    self.assertTrue(pool.reserve(PageList(), 3))        # now the entry goes
    self.assertEqual((pool.free_pages, cache.longest([(8, b"prefix")])), (4, (0, None)))


class PagedAttentionTest(absltest.TestCase):
  """Rows written through a shuffled page table and read back in blocks of pages equal the
  per-slot layout, over more than one block."""

  def test_gqa_and_latent_match_the_per_slot_cache(self):
    rng = np.random.default_rng(0)
    b, t, h, hkv, hd, vd, rows = 2, 3, 4, 2, 8, 6, 16
    length = 2 * blockwise.BLOCK + 64
    pages = length // rows
    table = rng.permutation(b * pages + 3)[:b * pages].reshape(b, pages).astype(np.int32)
    table[1, -5:] = b * pages + 3                       # pages never allocated
    pool_size = b * pages + 3
    k_cache = rng.normal(size=(b, hkv, length, hd)).astype(np.float32)
    v_cache = rng.normal(size=(b, hkv, vd, length)).astype(np.float32)
    k_pool = np.zeros((pool_size, hkv, rows, hd), np.float32)
    v_pool = np.zeros((pool_size, hkv, vd, rows), np.float32)
    for s in range(b):
      for i, page in enumerate(table[s]):
        if page < pool_size:
          k_pool[page] = k_cache[s, :, i * rows:(i + 1) * rows]
          v_pool[page] = v_cache[s, :, :, i * rows:(i + 1) * rows]
    q = rng.normal(size=(b, t, h, hd)).astype(np.float32)
    k = rng.normal(size=(b, t, hkv, hd)).astype(np.float32)
    v = rng.normal(size=(b, t, hkv, vd)).astype(np.float32)
    # Queries in the second block (slot 1 before its pages never allocated).
    positions = (blockwise.BLOCK + np.array([[188], [88]]) + np.arange(3)).astype(np.int32)
    attend = jax.jit(kv_cache.attention)
    want, _ = attend((k_cache, v_cache), q, k, v, kv_cache.AttentionMetadata(positions))
    got, _ = attend((k_pool, v_pool), q, k, v, kv_cache.AttentionMetadata(positions, table))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    width = 12
    rows_cache = rng.normal(size=(b, length, 1, width)).astype(np.float32)
    row_pool = np.zeros((pool_size, rows, 1, width), np.float32)
    for s in range(b):
      for i, page in enumerate(table[s]):
        if page < pool_size:
          row_pool[page] = rows_cache[s, i * rows:(i + 1) * rows]
    row = rng.normal(size=(b, t, 1, width)).astype(np.float32)
    q_lat = rng.normal(size=(b, t, h, 8)).astype(np.float32)
    q_pe = rng.normal(size=(b, t, h, 4)).astype(np.float32)
    selected = rng.random((b, t, length)) < 0.5
    latent = jax.jit(kv_cache.latent_attention, static_argnums=5)
    want, _ = latent(rows_cache, row, q_lat, q_pe, kv_cache.AttentionMetadata(positions), 0.5,
                     selected)
    got, _ = latent(row_pool, row, q_lat, q_pe, kv_cache.AttentionMetadata(positions, table),
                    0.5, selected)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

  def test_bfloat16_pools_hold_bits_and_attend_like_float32_of_the_same_values(self):
    rng = np.random.default_rng(1)
    b, t, h, hkv, hd, rows, pool_size = 1, 2, 4, 2, 8, 16, 40
    length = blockwise.BLOCK + 64
    table = rng.permutation(pool_size)[:length // rows][None].astype(np.int32)
    bf16 = lambda shape: rng.normal(size=shape).astype(jnp.bfloat16)
    k_pool, v_pool = bf16((pool_size, hkv, rows, hd)), bf16((pool_size, hkv, hd, rows))
    q = rng.normal(size=(b, t, h, hd)).astype(np.float32)
    # A float32 model's rows (bfloat16 values here, so the written bits are known) and a
    # bfloat16 model's.
    k, v = bf16((b, t, hkv, hd)).astype(np.float32), bf16((b, t, hkv, hd))
    positions = np.array([[blockwise.BLOCK + 30, blockwise.BLOCK + 31]], np.int32)
    meta = kv_cache.AttentionMetadata(positions, table)
    self.assertEqual(kv_cache.storage_dtype(jnp.bfloat16), np.uint16)
    self.assertEqual(kv_cache.storage_dtype(jnp.float32), np.float32)
    bits = lambda a: np.asarray(a).view(np.uint16)
    attend = jax.jit(kv_cache.attention)
    got, (k_bits, v_bits) = attend((bits(k_pool), bits(v_pool)), q, k, v, meta)
    want, _ = attend((k_pool.astype(np.float32), v_pool.astype(np.float32)), q,
                     k.astype(np.float32), v.astype(np.float32), meta)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    page, row = table[0, positions[0, 1] // rows], positions[0, 1] % rows
    np.testing.assert_array_equal(np.asarray(k_bits)[page, :, row],
                                  bits(k[0, 1].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(v_bits)[page, :, :, row], bits(v[0, 1]))
    # A row written to and read from a history pool comes back as the same bfloat16 values.
    hidden = bf16((b, t, 6))
    pool = kv_cache.scatter_rows(jnp.zeros((pool_size, rows, 6), np.uint16), hidden, meta)
    back = kv_cache.gather_rows(pool, meta)
    self.assertEqual(back.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(bits(back), bits(hidden))
    # The write updates the pool in place: no float32 copy of the whole pool in the program.
    compiled = jax.jit(kv_cache.attention).lower(
        (bits(k_pool), bits(v_pool)), q, k, v, meta).compile().as_text()
    self.assertNotIn(f"f32[{pool_size},{hkv},{rows},{hd}]", compiled)
    self.assertNotIn(f"bf16[{pool_size},{hkv},{rows},{hd}]", compiled)


def _requests(vocab: int, count: int, seed: int) -> list[Request]:
  """Prompts of 3..45 tokens (up to 3 chunks and 4 pages), every other one sampled."""
  rng = np.random.default_rng(seed)
  return [Request(prompt=rng.integers(0, vocab, size=int(n)).astype(np.int32),
                  max_new_tokens=NEW_TOKENS,
                  sampler=SamplerParams(temperature=0.8 * (i % 2), seed=i))
          for i, n in enumerate(rng.integers(3, 46, size=count))]


class PagedEngineTest(parameterized.TestCase):
  """Engines of 4 slots over a pool of 10 pages: many requests wait for pages, all finish."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.models = {}
    with tempfile.TemporaryDirectory() as tmp:
      for kind in ("glm4moe", "deepseek2", "glm-dsa"):
        cls.models[kind] = mtpjax.load(_write_model(kind, tmp))
      cls.models["glm4moe-bf16"] = mtpjax.load(_write_model("glm4moe", tmp), dtype="bfloat16")

  def engine(self, kind: str, *, native_mtp: bool = True, **settings):
    # No prefix cache unless a test asks (the pool's accounting expects every page back).
    settings = dict(dict(slots=4, max_len=MAX_LEN, prefill_buckets=BUCKETS, kv_pages=POOL,
                         draft_tokens=2, prefix_cache=0), **settings)
    return self.models[kind].engine(native_mtp=native_mtp, **settings)

  @parameterized.parameters(("glm4moe", 12), ("deepseek2", 8), ("glm-dsa", 8))
  def test_many_requests_over_a_small_pool(self, kind, count):
    model = self.models[kind]
    engine = self.engine(kind)
    scheduler = SlotScheduler(engine, adaptive=None)
    waited = []         # per emission: a request waited for pages while a slot was free
    requests = [dataclasses.replace(r, on_tokens=lambda _: waited.append(
        bool(scheduler.waiting) and None in scheduler.slots))
                for r in _requests(model.config.vocab_size, count, seed=len(kind))]
    results = scheduler.run(requests)
    self.assertEqual([len(r.tokens) for r in results], [NEW_TOKENS] * count)   # none failed
    self.assertTrue(any(waited))
    pages = scheduler.state.pages
    self.assertEqual((pages.free_pages, pages.reserved), (POOL, 0))
    np.testing.assert_array_equal(pages.table, POOL)
    for request, result in zip(requests, results):
      alone = SlotScheduler(engine, adaptive=None).run([request])[0]
      self.assertEqual(result.tokens, alone.tokens)
      if not request.sampler.temperature:       # greedy: a full forward's tokens
        sequence = np.concatenate([request.prompt, result.tokens[:-1]])
        reference = np.argmax(model.logits(sequence), axis=-1)[len(request.prompt) - 1:]
        self.assertEqual(result.tokens, reference.tolist())
    long = max(requests, key=lambda r: len(r.prompt)).prompt    # 3 chunks, over 3 pages
    check_prefix(self, model, engine, long, engine.init_state())

  def test_mtp_off_gives_the_same_tokens(self):
    requests = _requests(self.models["glm4moe"].config.vocab_size, 8, seed=1)
    outputs = [[r.tokens for r in SlotScheduler(self.engine("glm4moe", native_mtp=mtp),
                                                adaptive=None).run(requests)]
               for mtp in (True, False)]
    self.assertEqual(outputs[0], outputs[1])

  def test_bfloat16_pools_hold_bits_and_mtp_on_equals_off(self):
    requests = _requests(self.models["glm4moe"].config.vocab_size, 4, seed=2)
    outputs = []
    for mtp in (True, False):
      scheduler = SlotScheduler(self.engine("glm4moe-bf16", native_mtp=mtp), adaptive=None)
      outputs.append([r.tokens for r in scheduler.run(requests)])
    pools = jax.tree.leaves(scheduler.state.kv)
    self.assertEqual({a.dtype for a in pools}, {np.dtype(np.uint16)})
    mtp_pools = self.engine("glm4moe-bf16").init_state().mtp
    self.assertEqual({a.dtype for a in jax.tree.leaves(mtp_pools.kv) + [mtp_pools.hidden]},
                     {np.dtype(np.uint16)})
    self.assertEqual(outputs[0], outputs[1])

  def test_a_16_bit_kv_cache_halves_a_float32_models_pools(self):
    states = [self.engine("glm4moe", kv_cache_dtype=kv).init_state()
              for kv in ("auto", "bfloat16", "float16")]
    for state, stored in zip(states, (np.float32, np.uint16, np.float16)):
      self.assertEqual({a.dtype for a in jax.tree.leaves([state.kv, state.mtp.kv])},
                       {np.dtype(stored)})
      self.assertEqual(state.mtp.hidden.dtype, np.float32)   # the history stays the model's
    nbytes = [sum(a.nbytes for a in jax.tree.leaves([s.kv, s.mtp.kv])) for s in states]
    self.assertEqual(nbytes[1] * 2, nbytes[0])
    self.assertEqual(nbytes[2] * 2, nbytes[0])
    with self.assertRaises(errors.MtpjaxError) as caught:
      self.engine("glm4moe", kv_cache_dtype="int8")
    self.assertEqual(caught.exception.field, "engine.kv_cache_dtype")

  def test_a_float16_kv_cache_decodes_as_a_full_forward_over_float16_keys_and_values(self):
    # llama.cpp's default cache: greedy tokens with MTP on are a full forward's whose K/V are
    # float16, and that forward differs from the float32 one (the values were rounded).
    model = self.models["glm4moe"]
    request = _requests(model.config.vocab_size, 1, seed=5)[0]   # the first is greedy
    result = SlotScheduler(self.engine("glm4moe", kv_cache_dtype="float16"),
                           adaptive=None).run([request])[0]
    sequence = np.concatenate([request.prompt, result.tokens[:-1]])
    logits = model.logits(sequence, kv_cache_dtype="float16")
    reference = np.argmax(logits, axis=-1)[len(request.prompt) - 1:]
    self.assertEqual(result.tokens, reference.tolist())
    self.assertGreater(np.abs(logits - model.logits(sequence)).max(), 0.0)

  def test_a_reused_prefix_shares_its_pages(self):
    model = self.models["glm4moe"]
    engine = self.engine("glm4moe", prefix_cache=2)
    rng = np.random.default_rng(4)
    first = rng.integers(0, 500, size=45).astype(np.int32)     # caches its first 32 tokens
    second = np.concatenate([first[:40], rng.integers(0, 500, size=10).astype(np.int32)])
    scheduler = SlotScheduler(engine, adaptive=None)
    scheduler.run([Request(prompt=first, max_new_tokens=2)])
    pages = scheduler.state.pages
    self.assertEqual(pages.free_pages, POOL - 2)              # the entry holds 2 pages
    seen = []
    request = Request(prompt=second, max_new_tokens=NEW_TOKENS,
                      on_tokens=lambda _: seen.append((pages.table[0].copy(), pages.free_pages)))
    tokens = scheduler.run([request])[0].tokens
    table, free = seen[0]
    np.testing.assert_array_equal(table[:2], [0, 1])          # the cached pages themselves
    # The second prompt's 50 rows take 4 pages, 2 of them the entry's: 4 in use, not 6.
    self.assertEqual((int(np.sum(table < POOL)), free), (4, POOL - 4))
    cold_scheduler = SlotScheduler(self.engine("glm4moe"), adaptive=None)
    cold = cold_scheduler.run([request])[0].tokens
    self.assertEqual(tokens, cold)
    # The NextN rows of the prefix are those pages too: the entry keeps only h_31, and the
    # rows the second prompt read there equal a cold prefill's (on its pages 0 and 1).
    _, (entry_pages, before) = scheduler.state.prefixes.longest(
        scheduler.state.prefixes.page_keys(first))
    self.assertEqual((entry_pages, before.shape), ([0, 1], (1, model.config.hidden)))
    for shared, alone in zip(scheduler.state.mtp.kv, cold_scheduler.state.mtp.kv):
      np.testing.assert_allclose(np.asarray(shared)[:2], np.asarray(alone)[:2], atol=1e-5)
    sequence = np.concatenate([second, tokens[:-1]])
    self.assertEqual(tokens, np.argmax(model.logits(sequence), -1)[len(second) - 1:].tolist())

  def test_a_request_that_never_fits_is_refused(self):
    # A pool that holds one short request is enough to compile for it; two slots (MTP off
    # compiles least) are enough for warm-up to step one slot while another holds a prefill.
    engine = self.engine("glm4moe", kv_pages=2, slots=2, native_mtp=False)
    warm_up(engine)
    scheduler = SlotScheduler(engine, adaptive=None)
    with self.assertRaises(errors.KvPagesError) as caught:
      scheduler.submit(Request(prompt=np.ones(10, np.int32), max_new_tokens=200), lambda r: r)
    self.assertEqual(caught.exception.field, "engine.kv_pages")
    self.assertFalse(scheduler.busy)

  def test_device_kv_bytes_follow_the_pool(self):
    engine = self.engine("glm4moe")
    cfg, ec = self.models["glm4moe"].config, engine.engine_cfg
    per_row = cfg.n_kv_heads * (cfg.head_dim + cfg.value_dim) * 4          # float32 k + v
    state = engine.init_state()
    held = sum(a.nbytes for a in jax.tree.leaves(state.kv))
    self.assertEqual(held, cfg.n_layers * POOL * ec.kv_page * per_row)
    self.assertLess(held, cfg.n_layers * ec.slots * ec.cache_len * per_row)
    # The NextN block's cache and the MTP history (token, hidden) are pages of the same rows;
    # the head state itself holds only per-slot fields.
    per_mtp_row = per_row + 4 + cfg.hidden * 4
    mtp = sum(a.nbytes for a in jax.tree.leaves(state.mtp))
    self.assertEqual(mtp, POOL * ec.kv_page * per_mtp_row)
    self.assertLess(mtp, ec.slots * ec.cache_len * per_mtp_row)
    head = sum(a.nbytes for a in jax.tree.leaves(state.groups[0].head))
    self.assertLess(head, ec.slots * (cfg.hidden + 64) * 4)

  def test_paused_drafting_with_catch_up_equals_mtp_off(self):
    """Drafting, a pause of two catch-up passes, drafting again, over 8 pages for 2 slots (4
    slots' worth of full context would be 12; the NextN rows a slot's last pages cannot hold
    are dropped): greedy and sampled tokens equal MTP off, and the caught-up head drafts what
    it drafts over a pool of every slot at full context."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 500, size=n).astype(np.int32) for n in (20, 9)]
    samplers = [SamplerParams(), SamplerParams(temperature=0.8, seed=3)]
    schedule = [2] * 3 + [0] * (CATCH_UP_ROWS + 4) + [2] * 4

    def run(native_mtp: bool, windows: list, pool: int = 8):
      engine = self.engine("glm4moe", native_mtp=native_mtp, slots=2, kv_pages=pool)
      state = engine.init_state()
      tokens = []
      for slot, (prompt, sampler) in enumerate(zip(prompts, samplers)):
        prefix = engine.prefill(prompt, sampler, state=state)
        state = engine.insert(prefix, state, slot)
        tokens.append([int(prefix.current[0])])
      for window in windows:
        drafting = np.full(2, window, np.int32) if native_mtp else None
        state, result, _ = engine.step(state, np.ones(2, bool), drafting)
        for slot in range(2):
          tokens[slot] += committed_tokens(result[slot])
      return tokens, np.asarray(state.groups[0].head.slots.draft)

    on, drafts = run(True, schedule)
    off, _ = run(False, [0] * (max(map(len, on)) - 1))
    for slot in range(2):
      self.assertEqual(on[slot], off[slot][:len(on[slot])], f"slot {slot}")
    np.testing.assert_array_equal(drafts, run(True, schedule, pool=0)[1])

if __name__ == "__main__":
  absltest.main()
