"""Load test: drives a running server over loopback and checks every answer (issue 20).

For `--seconds`, `--concurrency` clients send a mix of streaming and non-streaming completions
and chats, requests whose client leaves early (a stream closed after its first token, a
non-streaming request abandoned after a short timeout) and bad requests (each must get its
4xx). Every good answer is compared with the same request run alone before the load (greedy
and seeded sampling are reproducible whatever the batch). Prints one JSON line: counts, p50/p99
time to first token and latency, queue wait (time to first token beyond the same request's
alone) and queue depth, /health latency, and the server's RSS growth after warm-up (with
--server_pid). With `--hostile=N`, N attackers send the request-preparation attacks and idle
and slowloris sockets press on the connection limits meanwhile (tools/hostile_clients.py): every
attack must get its 4xx. Exits 1 on any lost or wrong answer or unexpected status.

  python -m mtpjax.serve --config=configs/glm.py --config.engine.slots=8 --config.server.port=0
  python -m tools.load_test --url=http://127.0.0.1:PORT --seconds=300 --concurrency=64 \
      --server_pid=PID
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import pathlib
import random
import subprocess
import sys
import time

import httpx
from absl import app, flags

from tools import hostile_clients

_URL = flags.DEFINE_string("url", None, "the server, e.g. http://127.0.0.1:8000", required=True)
_SECONDS = flags.DEFINE_float("seconds", 60.0, "how long to drive the server")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 64, "clients sending at once")
_SERVER_PID = flags.DEFINE_integer("server_pid", 0, "the server's pid, for its RSS (0: skip)")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the request mix")
_WARM_UP = flags.DEFINE_float("warm_up_fraction", 0.2,
                              "RSS growth is measured from this fraction of the run on")
_HOSTILE = flags.DEFINE_integer("hostile", 0, "attackers sending the request-preparation "
                                "attacks beside the clients (tools/hostile_clients.py); 0: none")
_TEMPLATE_ESCAPE = flags.DEFINE_string(
    "template_escape", "", "with --hostile: message text that sends the served package's "
    "template into its slow branch (tools/escape_package.py); empty: no template attack")
_IDLE_SOCKETS = flags.DEFINE_integer("idle_sockets", 200,
                                     "with --hostile: sockets held open without a request")
_SLOW_SOCKETS = flags.DEFINE_integer("slow_sockets", 50, "with --hostile: sockets sending "
                                     "header lines one a second (slowloris)")

REPO = pathlib.Path(__file__).resolve().parents[1]
_WORDS = ("router", "expert", "token", "cache", "layer", "draft", "verify", "slot", "batch",
          "prefill", "decode", "stream")


@dataclasses.dataclass(frozen=True)
class Case:
  """One reproducible request: its route, body, and the answer it gets alone."""
  route: str
  body: dict
  text: str = ""
  finish_reason: str = ""
  ttft_s: float = 0.0


def _cases(model: str, rng: random.Random, count: int = 24) -> list[Case]:
  cases = []
  for i in range(count):
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 12)))
    sampling = ({"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": i} if i % 3 == 0
                else {"temperature": 0.0})
    common = {"model": model, "max_tokens": rng.choice((8, 32, 64, 128)), **sampling}
    if i % 2:
      cases.append(Case("/v1/chat/completions",
                        {**common, "messages": [{"role": "user", "content": words}]}))
    else:
      cases.append(Case("/v1/completions", {**common, "prompt": f"The {words}"}))
  return cases


def _bad_requests(model: str) -> list[tuple[str, dict, bytes, int]]:
  """(route, headers, body, expected status)."""
  json_type = {"content-type": "application/json"}
  dump = lambda body: json.dumps(body).encode()
  return [
      ("/v1/completions", json_type, b'{"model": ', 400),
      ("/v1/completions", {"content-type": "text/plain"},
       dump({"model": model, "prompt": "hi"}), 415),
      ("/v1/completions", json_type, dump({"model": model, "prompt": "hi", "top_k": 2**31}), 400),
      ("/v1/completions", json_type, dump({"model": "gpt-4", "prompt": "hi"}), 404),
      ("/v1/chat/completions", json_type, dump({"model": model, "messages": []}), 400),
      ("/v1/completions", json_type, dump({"model": model, "prompt": [1] * 100_000}), 400),
      ("/v1/completions", json_type, dump({"model": model, "prompt": "hi",
                                           "max_tokens": 10**9}), 400),
      ("/v1/chat/completions", json_type, b" " * (8 * 2**20), 413),
  ]


def _content(route: str, event: dict) -> str:
  choice = event["choices"][0]
  return choice["text"] if route == "/v1/completions" else choice["delta"].get("content") or ""


async def _stream(http: httpx.AsyncClient, case: Case, leave_after_first: bool = False
                  ) -> tuple[str, str | None, float | None, bool, int]:
  """(text, finish_reason, seconds to first content, ended with [DONE], content events)."""
  started = time.perf_counter()
  text, reason, first, done = [], None, None, False
  async with http.stream("POST", case.route, json={**case.body, "stream": True}) as response:
    if response.status_code != 200:
      raise RuntimeError(f"status {response.status_code}: {(await response.aread())[:200]}")
    async for line in response.aiter_lines():
      if not line.startswith("data: "):
        continue
      if line == "data: [DONE]":
        done = True
        break
      event = json.loads(line[6:])
      if "error" in event:
        raise RuntimeError(f"error event: {event['error']}")
      piece = _content(case.route, event)
      if piece and first is None:
        first = time.perf_counter() - started
        if leave_after_first:
          break
      text.append(piece)
      reason = event["choices"][0]["finish_reason"] or reason
  return "".join(text), reason, first, done, sum(1 for piece in text if piece)


async def _whole(http: httpx.AsyncClient, case: Case) -> tuple[str, str]:
  response = await http.post(case.route, json=case.body)
  if response.status_code != 200:
    raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
  choice = response.json()["choices"][0]
  text = choice["text"] if case.route == "/v1/completions" else choice["message"]["content"]
  return text, choice["finish_reason"]


def _rss_bytes(pid: int) -> int | None:
  try:
    with open(f"/proc/{pid}/status") as status:
      for line in status:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def _percentile(values: list[float], q: float) -> float | None:
  if not values:
    return None
  ordered = sorted(values)
  return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Run:
  def __init__(self, cases: list[Case], bad: list, rng: random.Random):
    self.cases = cases
    self.bad = bad
    self.rng = rng
    self.counts = collections.Counter()
    self.problems: list[str] = []
    self.ttft, self.latency, self.queue_wait, self.per_token = [], [], [], []
    self.queued = []

  def problem(self, kind: str, message: str) -> None:
    self.counts[kind] += 1
    if len(self.problems) < 20:
      self.problems.append(f"{kind}: {message}")

  async def one(self, http: httpx.AsyncClient) -> None:
    roll = self.rng.random()
    case = self.rng.choice(self.cases)
    started = time.perf_counter()
    try:
      if roll < 0.10:
        route, headers, body, status = self.rng.choice(self.bad)
        response = await http.post(route, content=body, headers=headers)
        if response.status_code == status and set(response.json()) == {"error"}:
          self.counts["refused_as_intended"] += 1
        else:
          self.problem("unexpected_status", f"{route} wanted {status}, got "
                       f"{response.status_code} {response.text[:200]}")
      elif roll < 0.15:
        await _stream(http, case, leave_after_first=True)
        self.counts["left_stream"] += 1
      elif roll < 0.20:
        try:
          await asyncio.wait_for(_whole(http, case), timeout=0.2)
          self.counts["left_whole_but_answered"] += 1
        except asyncio.TimeoutError:
          self.counts["left_whole"] += 1
      elif roll < 0.60:
        text, reason, first, done, pieces = await _stream(http, case)
        self.latency.append(time.perf_counter() - started)
        if not done:
          self.problem("lost", f"stream without [DONE]: {case.body}")
          return
        if first is not None:
          self.ttft.append(first)
          self.queue_wait.append(max(0.0, first - case.ttft_s))
          if pieces > 1:
            self.per_token.append((self.latency[-1] - first) / (pieces - 1))
        self.check(case, text, reason, "stream")
      else:
        text, reason = await _whole(http, case)
        self.latency.append(time.perf_counter() - started)
        self.check(case, text, reason, "whole")
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
      self.problem("lost", f"{type(e).__name__}: {e}")

  def check(self, case: Case, text: str, reason: str | None, kind: str) -> None:
    if (text, reason) == (case.text, case.finish_reason):
      self.counts[f"answered_{kind}"] += 1
    else:
      self.problem("wrong", f"{case.route} {case.body}: {text!r}/{reason} != "
                   f"{case.text!r}/{case.finish_reason}")

  async def client(self, http: httpx.AsyncClient, until: float) -> None:
    while time.monotonic() < until:
      await self.one(http)

  async def sample_queue(self, url: str, until: float) -> None:
    """The server's queue depth (/health), every 100 ms, on a connection of its own."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
      while time.monotonic() < until:
        response = await http.get("/health")
        if response.status_code == 200:
          self.queued.append(response.json().get("requests_queued", 0))
        else:
          self.problem("unexpected_status", f"/health answered {response.status_code}")
        await asyncio.sleep(0.1)


async def _alone(http: httpx.AsyncClient, cases: list[Case]) -> list[Case]:
  """Each case's answer and time to first token with nothing else running."""
  answered = []
  for case in cases:
    text, reason, first, done, _ = await _stream(http, case)
    whole = await _whole(http, case)
    if not done or whole != (text, reason):
      raise SystemExit(f"the server answers {case.body} differently streamed and whole: "
                       f"{(text, reason)} vs {whole}")
    answered.append(dataclasses.replace(case, text=text, finish_reason=reason,
                                        ttft_s=first or 0.0))
  return answered


async def _main() -> dict:
  url = _URL.value.rstrip("/")
  rng = random.Random(_SEED.value)
  limits = httpx.Limits(max_connections=_CONCURRENCY.value + 8,
                        max_keepalive_connections=_CONCURRENCY.value + 8)
  async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
    model = (await http.get("/v1/models")).json()["data"][0]["id"]
    cases = await _alone(http, _cases(model, rng))
    run = _Run(cases, _bad_requests(model), rng)
    started = time.monotonic()
    until = started + _SECONDS.value
    pid = _SERVER_PID.value
    rss = {"start": _rss_bytes(pid) if pid else None}

    async def sample_rss() -> None:
      await asyncio.sleep(_SECONDS.value * _WARM_UP.value)
      rss["warm"] = _rss_bytes(pid) if pid else None

    # /health latency from a process of its own (this one's GIL is busy with the clients).
    probe = subprocess.Popen([sys.executable, "-m", "tools.health_probe", url, "0.05"],
                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    probe.stdout.readline()                          # "probing"
    hostile = hostile_clients.Hostile(url, hostile_clients.attacks(model, _TEMPLATE_ESCAPE.value))
    attackers = [hostile.attacker(i, until) for i in range(_HOSTILE.value)]
    if _HOSTILE.value:
      attackers += [hostile.idle_sockets(_IDLE_SOCKETS.value, until, slow=False),
                    hostile.idle_sockets(_SLOW_SOCKETS.value, until, slow=True)]
    await asyncio.gather(sample_rss(), run.sample_queue(url, until), *attackers,
                         *(run.client(http, until) for _ in range(_CONCURRENCY.value)))
    elapsed = time.monotonic() - started
    health = json.loads(probe.communicate("", timeout=60)[0].splitlines()[-1])
    if health["statuses"] != [200]:
      run.problem("unexpected_status", f"/health answered {health['statuses']}")
    await asyncio.sleep(2.0)                        # abandoned requests end
    rss["end"] = _rss_bytes(pid) if pid else None
    idle = (await http.get("/health")).json()
  counts = run.counts
  answered = counts["answered_stream"] + counts["answered_whole"]
  growth = (None if not rss.get("warm") or not rss["end"]
            else 100.0 * (rss["end"] - rss["warm"]) / rss["warm"])
  return {
      "url": url, "model": model, "seconds": round(elapsed, 1),
      "concurrency": _CONCURRENCY.value, "requests": sum(counts.values()),
      "answered": answered, "answers_per_s": round(answered / elapsed, 2),
      "counts": dict(sorted(counts.items())),
      "lost": counts["lost"], "wrong": counts["wrong"],
      "unexpected_status": counts["unexpected_status"],
      "ttft_s": {"p50": _percentile(run.ttft, 0.5), "p99": _percentile(run.ttft, 0.99)},
      "latency_s": {"p50": _percentile(run.latency, 0.5), "p99": _percentile(run.latency, 0.99)},
      "time_per_token_s": {"p50": _percentile(run.per_token, 0.5),
                           "p99": _percentile(run.per_token, 0.99)},
      "queue_wait_s": {"p50": _percentile(run.queue_wait, 0.5),
                       "p99": _percentile(run.queue_wait, 0.99)},
      "queued": {"mean": sum(run.queued) / len(run.queued) if run.queued else None,
                 "max": max(run.queued, default=None)},
      "health_s": health,
      "rss_bytes": rss, "rss_growth_after_warm_up_pct": growth,
      "in_flight_after": idle.get("requests_in_flight"),
      "problems": run.problems,
      "hostile": hostile.report() if _HOSTILE.value else None,
  }


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per request otherwise
  report = asyncio.run(_main())
  print(json.dumps(report), flush=True)
  attacks = (report["hostile"] or {}).get("counts", {})
  if (report["lost"] or report["wrong"] or report["unexpected_status"]
      or attacks.get("attack_lost") or attacks.get("attack_unexpected_status")):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
