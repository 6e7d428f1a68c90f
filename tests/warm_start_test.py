"""The persistent compilation cache: on under the config's cache directory, off by a field.

Each case runs in a child process: JAX's cache settings are process-wide and would otherwise
send every later compile of the test run into a deleted folder.
"""

import pathlib
import subprocess
import sys
import tempfile
import textwrap

from absl.testing import absltest, parameterized

REPO = pathlib.Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    sys.path.insert(0, "configs")
    import glm
    from mtpjax import warm_start
    config = glm.get_config("tiny")
    config.unlock()
    config.cache_dir, config.compilation_cache = sys.argv[1], sys.argv[2] == "on"
    print(warm_start.enable_compilation_cache(config))
    jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(5.0)).block_until_ready()
""")


# Compiles into the cache, corrupts every entry, then compiles the same program again in a
# fresh process (JAX keeps no executable across processes), counting under CacheUse.
_CORRUPTED_CHILD = textwrap.dedent("""
    import pathlib, sys
    import jax, jax.numpy as jnp
    sys.path.insert(0, "configs")
    import glm
    from mtpjax import warm_start
    config = glm.get_config("tiny")
    config.unlock()
    config.cache_dir, config.compilation_cache = sys.argv[1], True
    folder = warm_start.enable_compilation_cache(config)
    if sys.argv[2] == "corrupt":
      for entry in folder.rglob("*"):
        if entry.is_file():
          entry.write_bytes(b"not an executable" * 8)
    with warm_start.CacheUse() as use:
      jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(5.0)).block_until_ready()
    print(len(use.unreadable), use.hits, use.summary())
""")


class CompilationCacheTest(parameterized.TestCase):

  def test_an_unreadable_entry_is_counted_and_logged(self):
    with tempfile.TemporaryDirectory() as tmp:
      run = lambda step: subprocess.run([sys.executable, "-c", _CORRUPTED_CHILD, tmp, step],
                                        cwd=REPO, capture_output=True, text=True, timeout=120,
                                        check=True)
      first = run("fill")
      self.assertEqual(first.stdout.split()[:2], ["0", "0"])
      second = run("corrupt")
      unreadable, hits = map(int, second.stdout.split()[:2])
      self.assertEqual(hits, 0)
      self.assertGreaterEqual(unreadable, 1)            # JAX may try the entry more than once
      self.assertIn(f"({unreadable} failed cache reads, those programs compiled again)",
                    second.stdout)
      self.assertIn("compilation cache: Error reading persistent compilation cache entry",
                    second.stderr)



  @parameterized.parameters("on", "off")
  def test_compiles_land_in_the_cache_dir_only_when_on(self, switch):
    with tempfile.TemporaryDirectory() as tmp:
      out = subprocess.run([sys.executable, "-c", _CHILD, tmp, switch], cwd=REPO,
                           capture_output=True, text=True, timeout=120, check=True).stdout
      folder = pathlib.Path(tmp) / "mtpjax" / "jax-compilation"
      entries = list(folder.iterdir()) if folder.is_dir() else []
      if switch == "on":
        self.assertEqual(out.strip(), str(folder))
        self.assertNotEmpty(entries)
      else:
        self.assertEqual(out.strip(), "None")
        self.assertEmpty(entries)


if __name__ == "__main__":
  absltest.main()
