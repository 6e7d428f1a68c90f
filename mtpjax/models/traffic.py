"""Weights each kind of decode step reads: the roofline figure for hosts bound by memory bandwidth.

A step at small batch reads every weight it multiplies by once, so on a CPU (or any host where
moving the weights costs more than the arithmetic) a step's time follows these bytes. Written
against `GlmModel`'s parameter names: `layers/`, `output_norm/`, `head/`, `embed/`, `mtp/`.
"""

from __future__ import annotations

import jax

from mtpjax.models.config import ModelConfig


def weight_mb_per_step(params, cfg: ModelConfig, slots: int = 1) -> dict[str, float]:
  """Weights read by a plain step and by a verify + draft step over `slots` slots, in MB.

  Routed experts count as min(E, rows x experts_used) of E (an upper bound: rows may share
  experts); embedding tables are gathered by row and not counted, unless one is the
  (tied) head. On a host bound by memory bandwidth (a CPU) the ratio of the two bounds what
  drafting can gain: about tokens_per_target_pass / ratio.
  """
  sizes = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)
    sizes[name] = leaf.size * leaf.dtype.itemsize

  def read(prefix: str, rows: int, skip: tuple[str, ...] = ()) -> float:
    total = 0.0
    for name, size in sizes.items():
      if not name.startswith(prefix) or name.startswith(skip):
        continue
      if "_exps/" in name:
        size *= min(cfg.n_experts, rows * cfg.n_experts_used) / cfg.n_experts
      total += size
    return total

  head = read("head/", 1) or read("embed/", 1)          # a tied head is the embedding table
  trunk = lambda rows: read("layers/", rows) + read("output_norm/", rows)
  plain = trunk(slots) + head
  mtp_head = read("mtp/head/", 1) or head               # else the NextN block uses the trunk's
  draft = read("mtp/", 2 * slots, skip=("mtp/embed/", "mtp/head/")) + mtp_head
  return {"plain": plain / 1e6, "verify_draft": (trunk(2 * slots) + head + draft) / 1e6}
