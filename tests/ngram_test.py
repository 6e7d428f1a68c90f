"""The host n-gram proposers (engine/ngram.py) against brute-force references written here
from their definitions, on random and repetitive token streams committed in random chunks."""

from __future__ import annotations

import random

from absl.testing import absltest
from absl.testing import parameterized

from mtpjax import speculative
from mtpjax.engine import ngram


# --- brute-force references: scan the whole history at every call ------------------------------

def _ends_with(tokens, end, pattern):
  """tokens[..end] ends with `pattern`."""
  n = len(pattern)
  return end + 1 >= n and tokens[end - n + 1:end + 1] == pattern


def simple_reference(history, prefix, limit, ngram_min, ngram_max):
  query = history + prefix
  for n in range(ngram_max, ngram_min - 1, -1):
    if len(query) < n:
      continue
    pattern = query[-n:]
    for end in range(len(history) - 2, -1, -1):          # needs a follower in history
      if _ends_with(history, end, pattern):
        return history[end + 1:end + 1 + limit]
  return []


def cache_reference(history, prefix, limit, ngram_min, ngram_max):
  context = history + prefix
  draft = []
  while len(draft) < limit:
    chosen = None
    for n in range(ngram_max, ngram_min - 1, -1):
      if len(context) < n:
        continue
      pattern = context[-n:]
      counts, last_seen = {}, {}
      for end in range(len(history) - 1):
        if _ends_with(history, end, pattern):
          follower = history[end + 1]
          counts[follower] = counts.get(follower, 0) + 1
          last_seen[follower] = end
      if counts:
        chosen = max(counts, key=lambda token: (counts[token], last_seen[token]))
        break
    if chosen is None:
      break
    draft.append(chosen)
    context = context + [chosen]
  return draft


def suffix_reference(history, prefix, limit, ngram_min, ngram_max):
  query = history + prefix
  best_length, best_end = 0, -1
  for end in range(len(history) - 1):
    length = 0
    while (length < ngram_max and length <= end and length < len(query)
           and history[end - length] == query[-1 - length]):
      length += 1
    if length >= best_length:                             # later ends win ties
      best_length, best_end = length, end
  if best_length < ngram_min:
    return []
  return history[best_end + 1:best_end + 1 + min(limit, max(2 * best_length, 4))]


REFERENCES = {"ngram-simple": simple_reference, "ngram-cache": cache_reference,
              "ngram-suffix": suffix_reference}


def _proposer(kind, ngram_min, ngram_max, max_tokens):
  if kind == "ngram-suffix":
    return ngram.SuffixNgramProposer(ngram_min, ngram_max, max_tokens, max_candidates=None)
  return ngram.PROPOSERS[kind](ngram_min, ngram_max, max_tokens)


def _stream(kind: str, rng: random.Random, length: int) -> list[int]:
  """Random tokens over a small or a larger vocabulary, or text that copies earlier spans."""
  if kind == "random_small":
    return [rng.randrange(3) for _ in range(length)]
  if kind == "random_large":
    return [rng.randrange(12) for _ in range(length)]
  tokens = [rng.randrange(30) for _ in range(12)]
  while len(tokens) < length:
    if rng.random() < 0.7:                                # copy an earlier span, maybe edited
      start = rng.randrange(len(tokens) - 4)
      span = tokens[start:start + rng.randint(4, 20)]
      if span and rng.random() < 0.3:
        span[rng.randrange(len(span))] = rng.randrange(30)
      tokens.extend(span)
    else:
      tokens.extend(rng.randrange(30) for _ in range(rng.randint(1, 5)))
  return tokens[:length]


class ReferenceTest(parameterized.TestCase):
  """At every step of a stream: propose (random limit, sometimes after a random read-only
  prefix), compare with the reference, then commit a random chunk."""

  @parameterized.product(
      kind=["ngram-simple", "ngram-cache", "ngram-suffix"],
      stream=["random_small", "random_large", "repetitive"])
  def test_matches_the_reference(self, kind, stream):
    windows = {"ngram-simple": [(1, 1), (2, 4), (3, 6)], "ngram-cache": [(1, 4), (2, 3), (4, 4)],
               "ngram-suffix": [(3, 3), (3, 8), (4, 16)]}[kind]
    rng = random.Random(f"{kind}/{stream}")
    checked = hits = 0
    for ngram_min, ngram_max in windows:
      max_tokens = rng.randint(1, 9)
      tokens = _stream(stream, rng, 220)
      proposer = _proposer(kind, ngram_min, ngram_max, max_tokens)
      committed = 0
      while committed < len(tokens):
        history = tokens[:committed]
        prefix = [] if rng.random() < 0.6 else tokens[committed:committed + rng.randint(1, 3)]
        limit = rng.randint(0, 10)
        expected = REFERENCES[kind](history, prefix, min(limit, max_tokens), ngram_min,
                                    ngram_max)
        self.assertEqual(proposer.propose(limit, prefix), expected,
                         msg=f"n {ngram_min}..{ngram_max} after {committed} tokens, prefix "
                             f"{prefix}, limit {limit}")
        self.assertEqual(proposer.tokens, history)        # proposing indexed nothing
        checked, hits = checked + 1, hits + bool(expected)
        step = rng.randint(1, 4) if committed else rng.randint(1, 30)
        proposer.commit(tokens[committed:committed + step])
        committed += step
    self.assertGreater(hits, 0, msg=f"{checked} proposals")   # the streams exercise matches


class HandComputedTest(absltest.TestCase):
  """Small cases worked out by hand."""

  def test_simple_proposes_what_followed_the_latest_match(self):
    proposer = ngram.SimpleNgramProposer(2, 2, 4)
    proposer.commit([0, 0, 2, 3, 9, 1, 7, 8, 2, 3])
    self.assertEqual(proposer.propose(4), [9, 1, 7, 8])
    self.assertEqual(proposer.propose(2), [9, 1])
    self.assertEqual(proposer.propose(4, prefix=[9]), [1, 7, 8, 2])   # "3 9" ends at index 4
    proposer.commit([5])
    self.assertEqual(proposer.propose(4), [])

  def test_simple_prefers_the_longest_n(self):
    proposer = ngram.SimpleNgramProposer(1, 3, 8)
    proposer.commit([1, 2, 3, 4, 9, 3, 5, 1, 2, 3])
    self.assertEqual(proposer.propose(8), [4, 9, 3, 5, 1, 2, 3])  # "1 2 3", not the later "3"
    self.assertEqual(proposer.propose(8, prefix=[7, 3]), [5, 1, 2, 3])  # only "3" matches

  def test_cache_follows_the_most_frequent_follower(self):
    proposer = ngram.CacheNgramProposer(1, 1, 3)
    proposer.commit([5, 1, 5, 2, 5, 1, 5, 2, 5, 2, 5])
    self.assertEqual(proposer.propose(3), [2, 5, 2])
    proposer.commit([1])                 # 1 and 2 follow 5 three times each: the newer, 1, wins
    self.assertEqual(proposer.propose(3, prefix=[5]), [1, 5, 1])

  def test_cache_window_is_at_most_four(self):
    with self.assertRaisesRegex(ValueError, "at most 4"):
      ngram.CacheNgramProposer(2, 5, 4)

  def test_suffix_prefers_the_longest_match_over_the_most_recent(self):
    proposer = ngram.SuffixNgramProposer(3, 16, 8)
    proposer.commit([1, 2, 3, 4, 5, 6, 8, 9, 2, 3, 4, 7, 8])
    self.assertEqual(proposer.propose(2, prefix=[1, 2, 3, 4]), [5, 6])

  def test_suffix_drafts_a_long_copied_run(self):
    proposer = ngram.SuffixNgramProposer(3, 16, 7)
    proposer.commit(list(range(11, 23)) + [11, 12, 13, 14, 15])
    self.assertEqual(proposer.propose(16), [16, 17, 18, 19, 20, 21, 22])

  def test_suffix_caps_the_draft_at_twice_the_match(self):
    proposer = ngram.SuffixNgramProposer(3, 16, 20)
    proposer.commit([7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 9, 1, 2, 3])
    self.assertEqual(proposer.propose(20), [4, 5, 6, 7, 8, 9])        # match 3 -> at most 6

  def test_suffix_stays_silent_below_ngram_min(self):
    proposer = ngram.SuffixNgramProposer(5, 16, 8)
    proposer.commit([1, 2, 3, 4, 9, 2, 3, 4])
    self.assertEqual(proposer.propose(4), [])

  def test_suffix_candidate_cap_bounds_the_scan(self):
    """The long match sits behind 70 newer 3-token ones: the capped lookup settles for the
    newest short match, the uncapped one finds the long one."""
    history = [100, 1, 2, 3, 4, 5, 9, 10, 11]
    for filler in range(200, 270):
      history += [filler, 3, 4, 5, filler + 100]
    history += [100, 1, 2, 3, 4, 5]
    capped, uncapped = (ngram.SuffixNgramProposer(3, 16, 3, max_candidates=cap)
                        for cap in (64, None))
    for proposer in (capped, uncapped):
      proposer.commit(history)
    self.assertEqual(uncapped.propose(3), [9, 10, 11])
    self.assertEqual(uncapped.propose(3), suffix_reference(history, [], 3, 3, 16))
    self.assertEqual(capped.propose(3), [369, 100, 1])    # what followed the newest filler
    self.assertEqual(ngram.SuffixNgramProposer(3, 16, 3).max_candidates, 64)

  def test_limits(self):
    proposer = ngram.SimpleNgramProposer(1, 1, 2)
    proposer.commit([1, 2, 3, 1])
    self.assertEqual(proposer.propose(9), [2, 3])         # max_proposal_tokens
    self.assertEqual(proposer.propose(0), [])
    self.assertEqual(proposer.propose(-1), [])
    with self.assertRaises(ValueError):
      ngram.SimpleNgramProposer(3, 2, 4)
    with self.assertRaises(ValueError):
      ngram.SuffixNgramProposer(2, 8, 4)


class FactoryTest(parameterized.TestCase):

  @parameterized.parameters(("ngram-simple", ngram.SimpleNgramProposer),
                            ("ngram-cache", ngram.CacheNgramProposer),
                            ("ngram-suffix", ngram.SuffixNgramProposer))
  def test_from_resolved_settings(self, kind, cls):
    settings = speculative.NgramSettings(kind, *speculative.NGRAM_DEFAULTS[kind],
                                         source="built-in defaults")
    proposer = ngram.proposer_for(settings)
    self.assertIsInstance(proposer, cls)
    self.assertEqual((proposer.ngram_min, proposer.ngram_max, proposer.max_proposal_tokens),
                     speculative.NGRAM_DEFAULTS[kind])


if __name__ == "__main__":
  absltest.main()
