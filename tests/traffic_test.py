"""`weight_mb_per_step` against a count by hand from the model's dimensions."""

import tempfile

from absl.testing import absltest, parameterized

import mtpjax
from mtpjax.models.traffic import weight_mb_per_step
from mtpjax.testing.tiny_glm import TinyGlmSpec, write_tiny_glm_gguf


def hand_count(spec: TinyGlmSpec, slots: int) -> dict[str, float]:
  """float32 weights read per step kind, written out from the glm4moe shapes (docs/MODEL.md §5-§7)."""
  d, heads, kv_heads, hd = spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim
  attention = (d * heads * hd + 2 * d * kv_heads * hd + heads * hd * d   # wq, wk, wv, wo
               + heads * hd + 2 * kv_heads * hd                          # q/k/v biases
               + 2 * hd)                                                 # q/k norms
  norms = 2 * d                                                          # attn, ffn norms
  dense = attention + norms + 3 * d * spec.ffn
  expert = 3 * spec.expert_ffn * d

  def moe(rows):
    routed = min(spec.n_experts, rows * spec.n_experts_used) * expert
    return (attention + norms + spec.n_experts * d + spec.n_experts      # router + its bias
            + spec.n_shared_experts * expert + routed)

  def trunk(rows):
    moe_layers = spec.n_trunk_layers - spec.leading_dense
    return spec.leading_dense * dense + moe_layers * moe(rows) + d       # + output norm

  head = spec.vocab_size * d
  nextn = 2 * d + 2 * d * d + moe(2 * slots) + d + head   # e/h norms, eh_proj, block, norm, head
  return {"plain": 4 * (trunk(slots) + head) / 1e6,
          "verify_draft": 4 * (trunk(2 * slots) + head + nextn) / 1e6}


class WeightTrafficTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("own_nextn_head", TinyGlmSpec(), 1),
      ("tied_heads", TinyGlmSpec(tied_head=True, nextn_head=False), 1),
      ("all_experts_in_verify", TinyGlmSpec(n_experts=4, n_experts_used=3, n_groups=1,
                                            groups_used=1), 1),
      ("three_slots", TinyGlmSpec(), 3))
  def test_matches_the_hand_count(self, spec, slots):
    with tempfile.TemporaryDirectory() as tmp:
      path = write_tiny_glm_gguf(f"{tmp}/tiny.gguf", spec)[0]
      model = mtpjax.load(str(path))
      _, params = model.weights(with_mtp=True)
    got = weight_mb_per_step(params, model.config, slots)
    expected = hand_count(spec, slots)
    self.assertAlmostEqual(got["plain"], expected["plain"], places=9)
    self.assertAlmostEqual(got["verify_draft"], expected["verify_draft"], places=9)


if __name__ == "__main__":
  absltest.main()
