"""llama.cpp's programs as the scale benchmarks use them: run one, read `llama-bench` output,
and the GGUF bytes a llama.cpp decode step reads. No flags, so tests import it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

import gguf

from mtpjax.package.writer import join_gguf


def parse_llama_bench(text: str) -> dict[tuple[str, int], float]:
  """`llama-bench -o json` output -> {("pp512" | "tg128", threads): mean tokens/s}; a test
  run after a context of d tokens (`-d`) is named as llama-bench prints it, "tg32 @ d1024"."""
  out = {}
  for row in json.loads(text):
    if row["n_prompt"] and not row["n_gen"]:
      test = f"pp{row['n_prompt']}"
    elif row["n_gen"] and not row["n_prompt"]:
      test = f"tg{row['n_gen']}"
    else:
      test = f"pp{row['n_prompt']}+tg{row['n_gen']}"
    out[(after_context(test, row.get("n_depth", 0)), int(row["n_threads"]))] = float(
        row["avg_ts"])
  return out


def after_context(test: str, depth: int) -> str:
  """llama-bench's name of `test` run after a context of `depth` tokens ("tg32 @ d1024")."""
  return f"{test} @ d{depth}" if depth else test


def run(binary: str, *args: str, stream: str = "stdout") -> str:
  """Runs a llama.cpp program with its folder on LD_LIBRARY_PATH; returns its `stream`
  ("stdout", or "stderr", where the examples log their counters)."""
  folder = str(pathlib.Path(binary).resolve().parent)
  env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
      p for p in (folder, os.environ.get("LD_LIBRARY_PATH", "")) if p))
  done = subprocess.run([binary, *args], env=env, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"{pathlib.Path(binary).name} failed ({done.returncode}):\n"
                       f"{done.stderr[-2000:]}")
  return getattr(done, stream)


_SPECULATIVE_COUNTERS = ("n_draft", "n_predict", "n_drafted", "n_accept")
_SPECULATIVE_LINE = re.compile(r"\b(" + "|".join(_SPECULATIVE_COUNTERS) + r")\s*=\s*(\d+)")


def parse_speculative(log: str) -> dict[str, int]:
  """`llama-speculative-simple`'s closing counters (its log lines `I n_drafted = 76`):
  {"n_draft", "n_predict", "n_drafted", "n_accept"}."""
  found = {name: int(value) for name, value in _SPECULATIVE_LINE.findall(log)}
  missing = [name for name in _SPECULATIVE_COUNTERS if name not in found]
  if missing:
    raise ValueError(f"llama-speculative-simple log lacks {', '.join(missing)}; its end:\n"
                     f"{log[-1000:]}")
  return found


def run_llama_bench(llama_bench: str, gguf_path: str, threads: int,
                    prompt: int | tuple[int, ...], gen: int, reps: int,
                    depths: tuple[int, ...] = (0,), batch: int | None = None
                    ) -> dict[tuple[str, int], float]:
  """`llama-bench` pp{prompt} (each of several) and tg{gen} at `threads` threads, each after a
  context of each of `depths` tokens: {(test, threads): tokens/s} (`parse_llama_bench`'s
  names). `batch`: the prompts' batch and micro-batch (`-b`, `-ub`), e.g. a prompt of 8 in one
  batch of 8 rows."""
  prompts = (prompt,) if isinstance(prompt, int) else prompt
  sizes = ("-b", str(batch), "-ub", str(batch)) if batch else ()
  return parse_llama_bench(run(llama_bench, "-m", gguf_path, "-p", ",".join(map(str, prompts)),
                               "-n", str(gen), "-d", ",".join(map(str, depths)),
                               "-t", str(threads), "-r", str(reps), *sizes, "-o", "json"))


def one_gguf(source: str, folder: str) -> str:
  """`source` as the one GGUF file llama.cpp reads: a GGUF file as it is, a layer package
  joined into `folder`."""
  if not pathlib.Path(source).is_dir():
    return source
  return str(join_gguf(source, pathlib.Path(folder) / "joined.gguf"))


def gguf_bytes_per_token(path: str) -> int:
  """GGUF tensor bytes one decoded token reads in llama.cpp with MTP off: every tensor but
  `token_embd` and the NextN blocks, expert tensors at top-k of E."""
  reader = gguf.GGUFReader(path)
  arch = reader.fields["general.architecture"].contents()
  field = lambda key, default=0: (reader.fields[f"{arch}.{key}"].contents()
                                  if f"{arch}.{key}" in reader.fields else default)
  trunk = field("block_count") - field("nextn_predict_layers")
  experts, used = field("expert_count"), field("expert_used_count")
  total = 0
  for tensor in reader.tensors:
    name = tensor.name
    if name == "token_embd.weight":
      continue
    if name.startswith("blk.") and int(name.split(".")[1]) >= trunk:
      continue
    share = min(experts, used) / experts if "_exps." in name and experts else 1.0
    total += int(tensor.n_bytes) * share
  return int(total)
