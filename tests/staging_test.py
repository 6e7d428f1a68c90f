"""Atomic directory output (`mtpjax.staging`): the swap and the removal of dead writers' folders.

A dead writer is a real child process that has exited; ages are set with os.utime."""

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest

from mtpjax import staging


def _dead_pid() -> int:
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


class StagingTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    work = tempfile.TemporaryDirectory()
    self.addCleanup(work.cleanup)
    self.parent = pathlib.Path(work.name)
    self.target = self.parent / "ckpt"

  def _folder(self, kind: str, owner: str, content: str = "x") -> pathlib.Path:
    folder = self.parent / f".ckpt.{kind}-{owner}.abc123"
    folder.mkdir()
    (folder / "file.txt").write_text(content)
    return folder

  def test_replace_keeps_nothing_aside(self):
    self.target.mkdir()
    (self.target / "file.txt").write_text("old")
    new = staging.make_staging_dir(self.target)
    (new / "file.txt").write_text("new")
    staging.replace_dir(new, self.target)
    self.assertEqual((self.target / "file.txt").read_text(), "new")
    self.assertEqual(sorted(p.name for p in self.parent.iterdir()), ["ckpt"])

  def test_dead_writers_staging_is_removed_and_live_one_kept(self):
    host = socket.gethostname()
    dead = self._folder("tmp", f"{_dead_pid()}@{host}")
    live = self._folder("tmp", f"{os.getppid()}@{host}")
    foreign = self._folder("tmp", f"{_dead_pid()}@another-host")
    removed = staging.remove_stale(self.target)
    self.assertEqual(removed, [dead])
    self.assertFalse(dead.exists())
    self.assertTrue(live.exists())
    self.assertTrue(foreign.exists())      # another host's pid cannot be checked: age only

  def test_old_folders_are_removed_whoever_made_them(self):
    unnamed = self.parent / ".ckpt.tmp-k2j3h4"       # the name older versions gave
    unnamed.mkdir()
    foreign = self._folder("tmp", f"{os.getppid()}@another-host")
    day_ago = time.time() - staging.STALE_AFTER_S - 60
    for folder in (unnamed, foreign):
      os.utime(folder, (day_ago, day_ago))
    young = self.parent / ".ckpt.tmp-young1"
    young.mkdir()
    self.assertCountEqual(staging.remove_stale(self.target), [unnamed, foreign])
    self.assertTrue(young.exists())

  def test_old_target_set_aside_by_a_writer_killed_mid_swap_is_restored(self):
    owner = f"{_dead_pid()}@{socket.gethostname()}"
    aside = self._folder("old", owner, "old")
    unswapped = self._folder("tmp", owner, "new")
    staging.remove_stale(self.target)
    self.assertEqual((self.target / "file.txt").read_text(), "old")
    self.assertFalse(aside.exists())
    self.assertFalse(unswapped.exists())

  def test_a_target_deleted_after_a_completed_swap_stays_deleted(self):
    # Killed while removing the old target: the new one had landed (no staging folder left).
    # The user deletes it; the next writer must not bring the older one back.
    aside = self._folder("old", f"{_dead_pid()}@{socket.gethostname()}", "old")
    staging.remove_stale(self.target)
    self.assertFalse(self.target.exists())
    self.assertFalse(aside.exists())

  def test_old_target_aside_is_dropped_when_a_new_target_exists(self):
    aside = self._folder("old", f"{_dead_pid()}@{socket.gethostname()}", "old")
    self.target.mkdir()
    (self.target / "file.txt").write_text("new")
    staging.remove_stale(self.target)
    self.assertEqual((self.target / "file.txt").read_text(), "new")
    self.assertFalse(aside.exists())

  def test_other_targets_folders_are_untouched(self):
    other = self.parent / ".ckpt2.tmp-1@x.abc"
    other.mkdir()
    os.utime(other, (0, 0))
    staging.remove_stale(self.target)
    self.assertTrue(other.exists())


if __name__ == "__main__":
  absltest.main()
