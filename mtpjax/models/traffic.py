"""Weights each kind of decode step reads: the roofline figure for hosts bound by memory bandwidth.

A step at small batch reads every weight it multiplies by once, so on a CPU (or any host where
moving the weights costs more than the arithmetic) a step's time follows these bytes. Written
against `GlmModel`'s parameter names: `layers/`, `output_norm/`, `head/`, `embed/`, `mtp/`.
"""

from __future__ import annotations

from flax import nnx

from mtpjax.gguf.quant_blocks import FIELD_NAMES
from mtpjax.models.config import ModelConfig


def weight_mb_per_step(params, cfg: ModelConfig, slots: int = 1) -> dict[str, float]:
  """Weights read by a plain step and by a verify + draft step over `slots` slots, in MB.

  Routed experts count as min(E, rows x experts_used) of E (an upper bound: rows may share
  experts); embedding tables are gathered by row and not counted, unless one is the
  (tied) head. On a host bound by memory bandwidth (a CPU) the ratio of the two bounds what
  drafting can gain: about tokens_per_target_pass / ratio.
  """
  # Parameter paths as the loader writes them, e.g. ('layers', 1, 'ffn', 'experts', 'gate_exps');
  # a quantized weight's block fields (`.../gate_exps/qs`, `.../d`) count as that weight.
  sizes: dict[tuple, int] = {}
  for path, leaf in nnx.to_flat_state(params):
    path = tuple(path[:-1]) if path[-1] in FIELD_NAMES else tuple(path)
    sizes[path] = sizes.get(path, 0) + leaf[...].nbytes

  def read(part: str, rows: int, skip: tuple[str, ...] = ()) -> float:
    """Bytes of the parameters under `part` (minus its `skip` children) that `rows` rows read."""
    total = 0.0
    for path, size in sizes.items():
      if path[0] != part or (len(path) > 1 and path[1] in skip):
        continue
      if str(path[-1]).endswith("_exps"):
        size *= min(cfg.n_experts, rows * cfg.n_experts_used) / cfg.n_experts
      total += size
    return total

  head = sizes.get(("head", "weight")) or sizes[("embed",)]   # a tied head is the embeddings
  mtp_head = sizes.get(("mtp", "head", "weight")) or head       # else the NextN uses the trunk's
  trunk = lambda rows: read("layers", rows) + read("output_norm", rows)
  plain = trunk(slots) + head
  draft = read("mtp", 2 * slots, skip=("embed", "head")) + mtp_head
  return {"plain": plain / 1e6, "verify_draft": (trunk(2 * slots) + head + draft) / 1e6}
