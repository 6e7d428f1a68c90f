"""Seeded fuzzing of the demo package (issue 20, item 7): mutated manifests, GGUF headers,
metadata values and tensor bytes are refused with typed errors, never an untyped exception, a
hang, an unbounded allocation or a silent load of changed tensor bytes.

About a minute on 2 cores; `python -m tools.fuzz_packages --cases=N` runs the long version.
"""

import logging
import multiprocessing
import os
import pathlib
import time

from absl.testing import absltest

import mtpjax
from mtpjax.package import writer_v2
from mtpjax.testing import package_fuzz, package_mutations
from package_examples import temporary_directory
from fixtures import FIXTURES

DEMO = pathlib.Path(mtpjax.__file__).resolve().parent / "assets" / "glm-demo"
CASES = 48
SEED = 20_000


def setUpModule():
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")    # the cases are forked
  logging.getLogger("gguf").setLevel(logging.WARNING)


class FuzzPackagesTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results = package_fuzz.run_cases(DEMO, range(SEED, SEED + CASES), workers=2,
                                         timeout_s=120)

  def test_no_case_fails(self):
    failing = [result for result in self.results
               if result.outcome in package_fuzz.FAILURES + ("harness_error",)]
    self.assertEqual(failing, [])

  def test_every_kind_of_mutation_ran_and_corruption_was_refused(self):
    kinds = {result.mutation.split(":")[0] for result in self.results}
    self.assertEqual(kinds, set(package_mutations.MUTATORS))
    refused = {result.mutation.split(":")[0] for result in self.results
               if result.outcome == "refused"}
    self.assertIn("tensor_bytes", refused)
    self.assertIn("header_field", refused)
    self.assertEqual([result for result in self.results
                      if result.mutation.startswith("tensor_bytes")
                      and result.outcome != "refused"], [])


class FileKindTest(absltest.TestCase):
  """The manifest or an artifact as a FIFO, a device node or a symlink out of the package: each
  refused with a typed error, none blocking the reader (issue 52's acceptance)."""

  def test_every_form_is_refused(self):
    results = package_fuzz.run_cases(DEMO, range(SEED, SEED + 12), workers=2, timeout_s=60,
                                     kinds=("file_kind",))
    self.assertEqual([r for r in results if r.outcome != "refused"], [])
    details = " ".join(result.mutation for result in results)
    for form in ("fifo", "outside_symlink", "model-package.json"):
      self.assertIn(form, details)
    self.assertRegex(details, "device|/dev/zero")


class FuzzV2PackageTest(absltest.TestCase):
  """The same mutators on a schema v2 package (the llama.cpp-made GLM fixture): its root, its
  payload artifacts and their headers are refused with typed errors too."""

  def test_no_case_fails(self):
    package = writer_v2.split_gguf_v2(FIXTURES / "glm4moe-tiny/glm4moe_h64-Q8_0.gguf",
                                      temporary_directory(self) / "v2",
                                      model_id="zai-org/glm4moe-tiny:Q8_0")
    results = package_fuzz.run_cases(package, range(SEED, SEED + 16), workers=2, timeout_s=120)
    self.assertEqual([result for result in results
                      if result.outcome in package_fuzz.FAILURES + ("harness_error",)], [])
    self.assertIn("refused", {result.outcome for result in results})


class HarnessTest(absltest.TestCase):
  """The watchdogs themselves: a case past its deadline is a hang, one past its address-space
  limit an allocation failure, never a pass."""

  def test_deadline(self):
    results = package_fuzz.run_cases(DEMO, [SEED], workers=1, timeout_s=0.05)
    self.assertEqual([result.outcome for result in results], ["hang"])

  def test_the_deadline_runs_from_the_mutation_not_the_copy(self):
    # The harness's own copy and edit (~20 s a case on a loaded machine) made false hangs.
    item = package_fuzz._Running(multiprocessing.get_context("fork"), DEMO,
                                 temporary_directory(self), SEED, 2 << 30, [], timeout_s=30)
    started = time.monotonic()
    self.addCleanup(item.process.join)
    self.addCleanup(item.process.kill)
    while item.mutation is None and item.process.is_alive():
      item.drain()
      time.sleep(0.01)
    self.assertIsNotNone(item.mutation)
    self.assertGreater(item.deadline, started + 30)

  def test_address_space_limit(self):
    # SEED + 3 edits a metadata value that still loads, so its child parses and reads tensors
    results = package_fuzz.run_cases(DEMO, [SEED + 3], workers=1, memory_bytes=1 << 20)
    self.assertIn(results[0].outcome, ("memory", "crash"))


if __name__ == "__main__":
  absltest.main()
