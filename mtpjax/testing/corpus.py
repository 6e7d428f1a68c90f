"""The offline text every machine has: the running interpreter's standard-library sources.

The demo model trains on it and the benchmarks draw held-out prompts from it, so both use the
same split: every 20th file (sorted by path) is held out.
"""

from __future__ import annotations

import pathlib
import sysconfig

HELD_OUT_EVERY = 20
_SKIP_PARTS = {"test", "tests", "site-packages", "encodings", "pydoc_data", "idle_test",
               "__pycache__", "lib2to3"}
_MAX_FILE_BYTES = 200_000     # larger files are generated tables, not code


def corpus_files() -> list[pathlib.Path]:
  """Standard-library sources, sorted; tests, site-packages and generated tables excluded."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = [p for p in root.rglob("*.py")
           if not _SKIP_PARTS.intersection(p.relative_to(root).parts)]
  return sorted(f for f in files if f.stat().st_size < _MAX_FILE_BYTES)


def split_corpus(max_files: int = 0) -> tuple[list[str], list[str]]:
  """(training texts, held-out texts), from the first `max_files` files (0: all)."""
  files = corpus_files()
  texts = [f.read_text(encoding="utf-8", errors="replace")
           for f in (files[:max_files] if max_files > 0 else files)]
  held_out = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY == 0]
  train = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY != 0]
  return train, held_out


def held_out_prompts(encode, count: int, length: int, seed: int = 0) -> list[list[int]]:
  """`count` prompts of `length` token ids cut at deterministic places of the held-out text."""
  import numpy as np
  ids = np.concatenate([np.asarray(encode(t), np.int32) for t in split_corpus()[1]])
  starts = np.random.default_rng(seed).integers(0, len(ids) - length, size=count)
  return [ids[s:s + length].tolist() for s in starts]


def repeated_code_prompts(encode, count: int, length: int, seed: int = 0) -> list[list[int]]:
  """`count` prompts of `length` token ids that repeat earlier text, as editing a file does: a
  held-out passage of `length` * 2 // 3 tokens, then its first third again, for the model to
  continue (the text n-gram drafting is for)."""
  passage = length * 2 // 3
  return [ids + ids[:length - passage]
          for ids in held_out_prompts(encode, count, passage, seed=seed)]
