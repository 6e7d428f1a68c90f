"""Serving benchmark: launch to first answer and streamed tokens/s, MTP on vs off, one process.

Starts `python -m mtpjax.serve --config=configs/glm.py` (the shipped demo model unless
--source is given) with native MTP on, then off, then on again, and prints one JSON line per
server: seconds from launch to ready and to the first answer, single-stream and 4-stream
tokens/s (medians over rounds) and the accept rate from /metrics.

  python -m tools.bench_serve --max_tokens=256 --rounds=3
  python -m tools.bench_serve --server_flags=--config.engine.slots=1
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import httpx
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
READY = re.compile(r"mtpjax ready: .* at (http://\S+)/v1")

_SOURCE = flags.DEFINE_string("source", "", "model source; empty: the config's default model")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 256, "tokens per completion")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "measured rounds per server")
_PROMPT = flags.DEFINE_string("prompt", "import os\nimport sys\n\n\ndef main():\n",
                              "the single-stream prompt")
_SERVER_FLAGS = flags.DEFINE_list(
    "server_flags", [], "flags for every server, e.g. --server_flags=--config.engine.slots=1")


def completion_stream(url: str, model: str, prompt: str, max_tokens: int):
  """(tokens, seconds from request to first token, seconds from first to last token)."""
  start = time.perf_counter()
  first = last = usage = None
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
          "stream_options": {"include_usage": True}}
  with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
    for line in response.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if event.get("usage"):
        usage = event["usage"]
        continue
      last = time.perf_counter()
      first = first or last
  return usage["completion_tokens"], first - start, last - first


def measure(extra_flags: list[str]) -> dict:
  cache_dir = tempfile.mkdtemp(prefix="mtpjax-bench-serve-")
  log_path = pathlib.Path(cache_dir) / "server.log"
  source = [f"--config.model.source={_SOURCE.value}"] if _SOURCE.value else []
  launched = time.perf_counter()
  with open(log_path, "wb") as log:
    server = subprocess.Popen(
        [sys.executable, "-m", "mtpjax.serve", "--config=configs/glm.py", *source,
         f"--config.cache_dir={cache_dir}", "--config.server.port=0", *extra_flags],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  try:
    while not (match := READY.search(log_path.read_text(errors="replace"))):
      if server.poll() is not None:
        raise SystemExit(log_path.read_text(errors="replace"))
      time.sleep(0.05)
    ready_s = time.perf_counter() - launched
    url = match.group(1)
    card = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]
    model = card["id"]
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1},
               timeout=600).raise_for_status()
    first_answer_s = time.perf_counter() - launched
    single = []
    for _ in range(_ROUNDS.value):
      tokens, _, decode = completion_stream(url, model, _PROMPT.value, _MAX_TOKENS.value)
      single.append((tokens - 1) / decode)
    prompts = [f"def handler_{i}(request):\n" for i in range(4)]
    concurrent_rates = []
    for _ in range(_ROUNDS.value):
      start = time.perf_counter()
      with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(
            lambda p: completion_stream(url, model, p, _MAX_TOKENS.value), prompts))
      concurrent_rates.append(sum(t for t, _, _ in results) / (time.perf_counter() - start))
    metrics = httpx.get(url + "/metrics", timeout=60).text
    accept = re.search(r"^mtpjax_native_mtp_accept_rate (\S+)", metrics, re.M)
    return {"flags": extra_flags, "model": model, "native_mtp": card["native_mtp"],
            "launch_to_ready_s": ready_s, "launch_to_first_answer_s": first_answer_s,
            "max_tokens": _MAX_TOKENS.value,
            "single_stream_tokens_per_s": sorted(single)[len(single) // 2],
            "four_streams_tokens_per_s": sorted(concurrent_rates)[len(concurrent_rates) // 2],
            "accept_rate": float(accept.group(1)) if accept else 0.0}
  finally:
    server.terminate()
    server.wait(30)


def main(argv):
  del argv
  for extra in ([], ["--config.defaults.speculative.strategy=disabled"], []):
    print(json.dumps(measure(_SERVER_FLAGS.value + extra)), flush=True)


if __name__ == "__main__":
  app.run(main)
