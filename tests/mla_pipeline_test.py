"""MLA archs through the same machinery as glm4moe: convert -> restore, and pipeline stages.

References are transformers' outputs in the fixtures (logits and the greedy continuation).
"""

import tempfile

import numpy as np
from absl.testing import absltest, parameterized

import mtpjax
from fixtures import FIXTURES
from mtpjax.convert import convert

CASES = (("deepseek2", "glm4moelite-tiny", "glm4moelite_h64-F32.gguf"),
         ("glm-dsa", "glmdsa-tiny", "glmdsa_h64-F32.gguf"))


class MlaConvertAndPipelineTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_checkpoint_and_two_stages_match_transformers(self, folder, filename):
    source = FIXTURES / folder / filename
    ref = np.load(FIXTURES / folder / "hf_ref.npz")
    with tempfile.TemporaryDirectory() as tmp:
      convert(source, f"{tmp}/ckpt", show_progress=False)
      restored = mtpjax.load(f"{tmp}/ckpt")
      np.testing.assert_allclose(restored.logits(ref["token_ids"]), ref["logits"], atol=1e-4)
    pipelined = mtpjax.load(str(source), stages=2)
    np.testing.assert_allclose(pipelined.logits(ref["token_ids"]), ref["logits"], atol=1e-4)
    result = pipelined.generate(ref["prompt_ids"], max_new_tokens=32,
                                speculative="native-mtp-n1", adaptive_drafting=False)
    self.assertEqual(result.tokens, ref["greedy_ids"].tolist())


if __name__ == "__main__":
  absltest.main()
