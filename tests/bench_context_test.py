"""`tools/bench_context.py` measures what it says: `ttft`'s cached prompt's whole chunks come
from the prefix cache, its cold prompt's from nowhere (the benchmark once built a scheduler,
and with it an empty prefix cache, per request, and timed two cold prefills); `steps` reports
the KV bytes of the pages a slot holds."""

import json
import subprocess
import sys

from absl.testing import absltest

from server_test import REPO


def bench_context(*flags: str) -> dict:
  """The JSON line of one run of the tool."""
  run = subprocess.run([sys.executable, "-m", "tools.bench_context", *flags], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
  if run.returncode:
    raise AssertionError(run.stderr[-3000:])
  return json.loads(run.stdout.strip().splitlines()[-1])


class BenchContextTest(absltest.TestCase):

  def test_ttft_reuses_the_shared_chunks(self):
    # 300 tokens, 280 shared: the largest bucket (256) is the one whole chunk to reuse (two
    # buckets: 256 + a 64-row tail, fewer programs to compile than the default five).
    result = bench_context("--modes=ttft", "--long_prompt=300", "--shared=280",
                           "--ttft_rounds=1", "--max_len=512", "--prefill_buckets=64,256")
    self.assertEqual((result["prompt_tokens"], result["shared_tokens"], result["cached_tokens"],
                      result["cold_cached_tokens"]), (300, 280, 256, 0))
    self.assertGreater(result["cold_ttft_s"], 0)

  def test_steps_report_the_pages_a_slot_holds(self):
    # The demo model: 4 layers x 2 KV heads x (64 + 64) float32 values a row, 16 rows a page.
    page_bytes = 4 * 2 * (64 + 64) * 4 * 16
    result = bench_context("--modes=steps", "--held=128,1024", "--steps=2", "--step_rounds=1",
                           "--context=2048", "--kv_cache_dtype=auto,bfloat16")
    self.assertEqual(result["max_len"], 2048)
    # After 2 steps from position p the slot holds rows 0..p + 1: ceil((p + 2) / 16) pages.
    self.assertEqual(result["kv_bytes_held"], [9 * page_bytes, 65 * page_bytes])
    # The same pages of bfloat16 K/V: half the bytes.
    self.assertEqual(result["blockwise_kv_bfloat16_kv_bytes_held"],
                     [9 * page_bytes // 2, 65 * page_bytes // 2])
    self.assertLen(result["blockwise_kv_bfloat16_step_ms"], 2)
    self.assertLen(result["blockwise_step_ms"], 2)
    self.assertLen(result["whole_cache_step_ms"], 2)
    ms = result["blockwise_step_ms"]
    self.assertEqual(result["blockwise_step_vs_first"], [1.0, round(ms[1] / ms[0], 3)])

  def test_a_context_too_short_for_the_points_is_refused(self):
    run = subprocess.run([sys.executable, "-m", "tools.bench_context", "--modes=steps",
                          "--held=1024", "--context=1024"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    self.assertNotEqual(run.returncode, 0)
    self.assertIn("--context=1024 cannot hold --held up to 1024", run.stderr)


if __name__ == "__main__":
  absltest.main()
