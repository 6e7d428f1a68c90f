"""Issue #17's server acceptance on the demo model: a long prompt, a long chat, a prompt past
the context, and more concurrent streams than the KV page pool holds at once.

Two real servers (`python -m mtpjax.serve --config=configs/glm.py`, the shipped demo package
at its context of 8192) are launched together in setUpModule, so that their compiles overlap
on a 2-core CPU; each class waits for its own. References are independent of the servers:
greedy answers of the package's engine in this process with MTP off, one request alone (the
long-context server drafts with native MTP), chat prompts rendered by the package's own
template and tokenizer, and for the streams that share a small page pool, the same request
sent alone.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import os
import pathlib
import shutil
import tempfile
import threading

import numpy as np
from absl.testing import absltest

from mtpjax import embedded
from server_test import ServerProcess, metric, open_clients, package_tokenizer

DEMO_MODEL = "mtpjax-glm-demo"
LONG_PROMPT_TOKENS = 6100
NEW_TOKENS = 12
# PagePoolTest's pool: its 4 slots of the streams below need more pages than it holds, and
# the largest prefill bucket (64 tokens, 5 pages with its first token) fits for warm-up.
KV_PAGE, KV_PAGES, SLOTS = 16, 8, 4


def twenty_turn_chat() -> list[dict]:
  """19 user/assistant exchanges, then the 20th question."""
  messages = []
  for i in range(19):
    messages.append({"role": "user", "content":
                     f"Turn {i}: what does parse_{i}(argv) in module m{i}.py return?"})
    messages.append({"role": "assistant", "content":
                     f"It returns a namespace of {i} parsed options, or raises SystemExit."})
  messages.append({"role": "user", "content": "Now write def main(argv): that uses them all."})
  return messages


def shown(tokenizer, tokens: list[int], stops) -> str:
  """The text the server returns for `tokens`: a final stop token is not shown."""
  return tokenizer.decode(tokens[:-1] if tokens and tokens[-1] in stops else tokens,
                          skip_special=True)


class _DemoServerTest(absltest.TestCase):
  """One demo server per class, launched by `setUpModule`; subclasses name the flags."""

  FLAGS: tuple[str, ...] = ()

  @classmethod
  def launch(cls) -> None:
    cls.tmp = tempfile.mkdtemp(prefix="mtpjax-context-test-")
    cls.server = ServerProcess(cls.tmp, pathlib.Path(cls.tmp) / "server.log", *cls.FLAGS,
                               tiny=False)

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tokenizer, cls.template = package_tokenizer(embedded.DEMO_PACKAGE)
    cls.prepare_references()
    cls.url = cls.server.wait_ready()
    open_clients(cls)

  @classmethod
  def prepare_references(cls):
    """Work done while the servers compile."""

  @classmethod
  def tearDownClass(cls):
    cls.http.close()
    cls.client.close()
    super().tearDownClass()

  def metrics(self) -> str:
    response = self.http.get("/metrics")
    self.assertEqual(response.status_code, 200)
    return response.text

  def assert_still_serving(self):
    response = self.http.post("/v1/completions", json={
        "model": DEMO_MODEL, "prompt": "import os\n", "max_tokens": 4})
    self.assertEqual(response.status_code, 200, response.text)
    self.assertEqual(response.json()["usage"]["completion_tokens"], 4)


class LongContextTest(_DemoServerTest):
  """The default pool (every slot at full context): long prompts, long chats, the limit. One
  slot and two prefill buckets keep the compile short; the prompts here are chunked by 256."""

  FLAGS = ("--config.engine.slots=1", "--config.engine.prefill_buckets=(32,256)")

  @classmethod
  def prepare_references(cls):
    """Greedy answers of one request alone, in this process, with MTP off; one engine at the
    servers' context serves them all (one compile)."""
    import mtpjax  # jax loads here, while the servers compile
    from mtpjax.engine.scheduler import Request, SlotScheduler
    engine = mtpjax.load(str(embedded.DEMO_PACKAGE)).engine(
        native_mtp=False, max_len=8192, slots=1, prefill_buckets=(32, 256))
    tokenizer = cls.tokenizer

    def greedy(ids: list[int], stops) -> list[int]:
      request = Request(prompt=np.asarray(ids, np.int32), max_new_tokens=NEW_TOKENS,
                        stop_ids=frozenset(stops))
      return SlotScheduler(engine).run([request])[0].tokens

    # Real code (the demo was trained on the standard library): ~6000 tokens of one module,
    # a length whose last 256-token chunk fills the largest bucket, like the chats' below.
    cls.long_prompt = tokenizer.encode(pathlib.Path(inspect.__file__).read_text())
    cls.long_prompt = cls.long_prompt[:LONG_PROMPT_TOKENS]
    assert len(cls.long_prompt) == LONG_PROMPT_TOKENS
    cls.long_reference = greedy(cls.long_prompt, [tokenizer.special_ids["eos"]])
    # The chat, then its next turn built on the reference's reply (the server's must equal it).
    cls.chat_references = []
    messages = twenty_turn_chat()
    for follow_up in (None, "And the tests for it?"):
      if follow_up is not None:
        messages = messages + [{"role": "assistant", "content": cls.chat_references[-1][1]},
                               {"role": "user", "content": follow_up}]
      ids = tokenizer.encode(cls.template.render(messages, add_generation_prompt=True))
      tokens = greedy(ids, tokenizer.stop_ids)
      cls.chat_references.append((messages, shown(tokenizer, tokens, tokenizer.stop_ids),
                                  len(ids), len(tokens)))

  def chat_ids(self, messages) -> list[int]:
    return self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True))

  def assert_chat_reply_equals(self, messages, text, prompt_tokens, completion_tokens):
    reply = self.client.chat.completions.create(model=DEMO_MODEL, messages=messages,
                                                max_tokens=NEW_TOKENS)
    self.assertEqual(reply.choices[0].message.content, text)
    self.assertEqual((reply.usage.prompt_tokens, reply.usage.completion_tokens),
                     (prompt_tokens, completion_tokens))

  def test_a_6100_token_prompt_equals_the_reference(self):
    eos = self.tokenizer.special_ids["eos"]
    reply = self.client.completions.create(model=DEMO_MODEL, prompt=self.long_prompt,
                                           max_tokens=NEW_TOKENS)
    self.assertEqual(reply.usage.prompt_tokens, LONG_PROMPT_TOKENS)
    self.assertEqual(reply.usage.completion_tokens, len(self.long_reference))
    self.assertEqual(reply.choices[0].text, shown(self.tokenizer, self.long_reference, {eos}))

  def test_a_twenty_turn_chat_equals_the_reference_and_its_next_turn_reuses_the_prefix(self):
    first, second = self.chat_references
    messages, extended = first[0], second[0]
    self.assertEqual(sum(m["role"] == "user" for m in messages), 20)
    self.assert_chat_reply_equals(*first)
    before = self.metrics()
    self.assert_chat_reply_equals(*second)
    after = self.metrics()
    # The whole 256-token pages the two renders share came from the prefix cache.
    common = len(os.path.commonprefix([self.chat_ids(messages), self.chat_ids(extended)]))
    cached = (metric(after, "mtpjax_prompt_cached_tokens_total")
              - metric(before, "mtpjax_prompt_cached_tokens_total"))
    self.assertGreaterEqual(common, 512)
    self.assertEqual(cached, common // 256 * 256)

  def test_a_prompt_longer_than_the_context_is_refused_and_the_server_keeps_serving(self):
    vocab = self.tokenizer.vocab_size
    too_long = [i % vocab for i in range(8192)]                  # the context is 8192
    source = pathlib.Path(inspect.__file__).read_text()
    requests = [("/v1/completions", {"prompt": too_long, "max_tokens": 4}, "prompt"),
                ("/v1/completions", {"prompt": self.long_prompt, "max_tokens": 4000},
                 "max_tokens"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": source}],
                                          "stream": True}, "messages")]
    for path, body, param in requests:
      response = self.http.post(path, json={"model": DEMO_MODEL, **body})
      self.assertEqual(response.status_code, 400, response.text)
      self.assertEqual(response.json()["error"]["code"], "context_length_exceeded")
      self.assertEqual(response.json()["error"]["type"], "invalid_request_error")
      self.assertEqual(response.json()["error"]["param"], param)
      self.assertIn("8192", response.json()["error"]["message"])
    self.assert_still_serving()


class PagePoolTest(_DemoServerTest):
  """4 slots over a pool of 8 pages: requests wait for pages, none fails. MTP off halves the
  steps to compile; LongContextTest drafts."""

  FLAGS = ("--config.defaults.speculative.strategy=disabled", f"--config.engine.slots={SLOTS}",
           f"--config.engine.kv_page={KV_PAGE}", f"--config.engine.kv_pages={KV_PAGES}",
           "--config.engine.prefill_buckets=(16,32,64)")

  def request(self, i: int) -> tuple[str, dict]:
    """The i-th of 16 requests: chat and completions, greedy and seeded sampling, 16-32
    tokens."""
    body = {"model": DEMO_MODEL, "max_tokens": 16 + 8 * (i % 3)}
    if i % 2:
      body.update(temperature=0.8, top_p=0.9, seed=1000 + i)
    question = f"Question {i}: what does expert {i % 8} do with token {i * 7}?"
    if i % 4 < 2:
      return "/v1/completions", {**body, "prompt": question}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": question}]}

  def text_of(self, path: str, body: dict) -> tuple[str, int]:
    """(text, completion tokens) of one streamed request; it must answer 200."""
    text, usage = [], None
    with self.http.stream("POST", path, json={**body, "stream": True,
                                              "stream_options": {"include_usage": True}}
                          ) as response:
      self.assertEqual(response.status_code, 200)
      for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        event = json.loads(line[len("data: "):])
        self.assertNotIn("error", event)
        if event.get("usage"):
          usage = event["usage"]
        for choice in event["choices"]:
          text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text), usage["completion_tokens"]

  def test_64_streams_over_a_small_pool_equal_their_solo_answers(self):
    distinct = [self.request(i) for i in range(16)]
    alone = [self.text_of(path, body) for path, body in distinct] * 4
    requests = distinct * 4                   # each four times at once, in different slots
    rows = [len(self.tokenizer.encode(body["prompt"])) + body["max_tokens"] + 1
            for path, body in requests if "prompt" in body]
    fewest = -(-min(rows) // KV_PAGE)                  # pages a request reserves
    self.assertGreater(SLOTS * fewest, KV_PAGES)     # a full batch never fits the pool
    before = self.metrics()
    barrier = threading.Barrier(len(requests))

    def run(request):
      barrier.wait()
      return self.text_of(*request)

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
      together = list(pool.map(run, requests))
    after = self.metrics()
    for i, (solo, both) in enumerate(zip(alone, together)):
      self.assertEqual(both, solo, requests[i])
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)
    self.assertEqual(delta("mtpjax_requests_total"), 64)
    self.assertEqual(delta("mtpjax_request_errors_total"), 0)
    # The pool, not the slots, bounded the batch: no step ran more requests than its pages
    # hold, and some ran several.
    most = KV_PAGES // fewest
    steps = delta("mtpjax_batch_occupancy_count")
    within = delta("mtpjax_batch_occupancy_bucket", le=str((most + 0.5) / SLOTS))
    single = delta("mtpjax_batch_occupancy_bucket", le=str(1.5 / SLOTS))
    self.assertEqual(within, steps)
    self.assertGreater(steps, single)

  def test_a_request_that_could_never_fit_the_pool_is_refused(self):
    # 2 prompt tokens + 400 new need 26 pages of 16 rows: within the context, past the pool.
    for stream in (False, True):
      response = self.http.post("/v1/completions", json={
          "model": DEMO_MODEL, "prompt": "import os", "max_tokens": 400, "stream": stream})
      self.assertEqual(response.status_code, 400, response.text)
      error = response.json()["error"]
      self.assertEqual((error["code"], error["param"], error["type"]),
                       ("kv_pages_exceeded", "max_tokens", "invalid_request_error"))
      self.assertIn("engine.kv_pages", error["message"])
      self.assertIn(f"the pool holds {KV_PAGES}", error["message"])
    self.assert_still_serving()


def setUpModule():
  """Both servers compile at once: on a 2-core CPU one compile at a time leaves a core idle."""
  for cls in (LongContextTest, PagePoolTest):
    cls.launch()


def tearDownModule():
  for cls in (LongContextTest, PagePoolTest):
    cls.server.stop()
    shutil.rmtree(cls.tmp, ignore_errors=True)


if __name__ == "__main__":
  absltest.main()
