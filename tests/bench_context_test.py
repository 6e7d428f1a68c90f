"""`tools/bench_context.py --modes=ttft` measures what it says: its cached prompt's whole
chunks come from the prefix cache, its cold prompt's from nowhere (the benchmark once built a
scheduler, and with it an empty prefix cache, per request, and timed two cold prefills)."""

import json
import subprocess
import sys

from absl.testing import absltest

from server_test import REPO


class BenchContextTest(absltest.TestCase):

  def test_ttft_reuses_the_shared_chunks(self):
    # 300 tokens, 280 shared: the largest bucket (256) is the one whole chunk to reuse.
    run = subprocess.run(
        [sys.executable, "-m", "tools.bench_context", "--modes=ttft", "--long_prompt=300",
         "--shared=280", "--ttft_rounds=1", "--max_len=512"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    result = json.loads(run.stdout.strip().splitlines()[-1])
    self.assertEqual((result["prompt_tokens"], result["shared_tokens"], result["cached_tokens"],
                      result["cold_cached_tokens"]), (300, 280, 256, 0))
    self.assertGreater(result["cold_ttft_s"], 0)


if __name__ == "__main__":
  absltest.main()
