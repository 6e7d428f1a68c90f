"""The hostile mix `tools/load_test.py --hostile` runs beside its well-behaved clients.

Attackers loop over the request-preparation attacks of issue 52 (a 3 MB body of 100,000
messages, a 4,000,000-character completions prompt and chat message, and, with
`--template_escape`, a chat whose text sends the served package's template into its slow branch:
`tools/escape_package.py` makes such a package), each of which must be refused with its 4xx; and
idle and slowloris sockets are held open against the connection limits (reopened as the server
closes them). Counts and refusal times come back for the report.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time

import httpx

# (name, route, body, the status it must get)
Attack = tuple[str, str, bytes, int]


def attacks(model: str, template_escape: str = "") -> list[Attack]:
  dump = lambda body: json.dumps(body).encode()
  found = [
      ("many_messages", "/v1/chat/completions",
       dump({"model": model, "max_tokens": 4,
             "messages": [{"role": "user", "content": "x"}] * 100_000}), 400),
      ("long_prompt", "/v1/completions",
       dump({"model": model, "max_tokens": 4, "prompt": "word " * 800_000}), 400),
      ("long_chat", "/v1/chat/completions",
       dump({"model": model, "max_tokens": 4,
             "messages": [{"role": "user", "content": "word " * 800_000}]}), 400),
  ]
  if template_escape:
    found.append(("template_escape", "/v1/chat/completions",
                  dump({"model": model, "max_tokens": 4,
                        "messages": [{"role": "user", "content": template_escape}]}), 400))
  return found


class Hostile:
  """Attackers and held sockets; `report()` is what they saw."""

  def __init__(self, url: str, attacks: list[Attack]):
    self.url = url
    self.attacks = attacks
    self.counts = collections.Counter()
    self.refusal_s: dict[str, list[float]] = collections.defaultdict(list)
    self.problems: list[str] = []

  async def attacker(self, index: int, until: float) -> None:
    async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
      turn = index
      while time.monotonic() < until:
        name, route, body, status = self.attacks[turn % len(self.attacks)]
        turn += 1
        started = time.perf_counter()
        try:
          response = await http.post(route, content=body,
                                     headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
          self.counts["attack_lost"] += 1
          self.problems.append(f"{name}: {type(e).__name__}: {e}"[:200])
          continue
        self.refusal_s[name].append(time.perf_counter() - started)
        if response.status_code == status:
          self.counts[f"refused_{name}"] += 1
        else:
          self.counts["attack_unexpected_status"] += 1
          self.problems.append(f"{name}: wanted {status}, got {response.status_code} "
                               f"{response.text[:160]}")

  async def idle_sockets(self, count: int, until: float, slow: bool) -> None:
    """`count` sockets that never finish a request (slow: a header line every second),
    reopened whenever the server closes one."""
    url = httpx.URL(self.url)
    host, port = url.host, url.port

    async def hold() -> None:
      while time.monotonic() < until:
        try:
          reader, writer = await asyncio.open_connection(host, port)
        except OSError:
          self.counts["socket_refused"] += 1
          await asyncio.sleep(0.5)
          continue
        self.counts["sockets_opened"] += 1
        try:
          if slow:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
          while time.monotonic() < until:
            if slow:
              writer.write(b"x-slow: 1\r\n")
              await writer.drain()
            if await _closed_within(reader, 1.0):
              self.counts["sockets_closed_by_server"] += 1
              break
        except OSError:
          self.counts["sockets_closed_by_server"] += 1
        finally:
          writer.close()

    await asyncio.gather(*(hold() for _ in range(count)))

  def report(self) -> dict:
    median = lambda values: sorted(values)[len(values) // 2] if values else None
    return {"counts": dict(sorted(self.counts.items())),
            "refusal_s_median": {name: median(v) for name, v in sorted(self.refusal_s.items())},
            "refusal_s_max": {name: max(v) for name, v in sorted(self.refusal_s.items())},
            "problems": self.problems[:20]}


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
  try:
    return await asyncio.wait_for(reader.read(4096), seconds) == b""
  except asyncio.TimeoutError:
    return False
