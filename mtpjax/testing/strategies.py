"""Package strategies the seed packages do not declare, added to a package for tests and
benchmarks: a composite (native MTP extended by an n-gram proposer) in the proposers form."""

from __future__ import annotations

import json
import pathlib
import shutil

from mtpjax.package import writer

COMPOSITE_ID = "mtp-ngram"


def declare_composite(package_dir: str | pathlib.Path, *, strategy_id: str = COMPOSITE_ID,
                      extender: dict | None = None, extension_policy: dict | None = None
                      ) -> pathlib.Path:
  """Adds an n-gram proposer and a composite strategy `strategy_id` (the package's native-MTP
  proposer extended by it) to a v1 package's manifest, in place; the default stays as it was.

  A seed-era package declares native MTP inline; its strategy becomes the proposer `mtp`."""
  path = pathlib.Path(package_dir) / "model-package.json"
  manifest = json.loads(path.read_text())
  block = manifest["generation"]["speculative_decoding"]
  proposers = block.setdefault("proposers", {})
  if not any(p.get("type") == "native-mtp" for p in proposers.values()):
    inline = block["strategies"][block["default"]]
    proposers["mtp"] = {key: inline[key]
                        for key in ("type", "prediction_depth", "layer_indices")}
  primary = next(name for name, p in proposers.items() if p.get("type") == "native-mtp")
  proposers["ngram"] = extender or {"type": "ngram-simple", "ngram_min": 2, "ngram_max": 4,
                                    "max_proposal_tokens": 4}
  block["strategies"][strategy_id] = {
      "type": "composite", "primary": primary, "extender": "ngram",
      "extension_policy": extension_policy or {"initial_tokens": 2, "max_tokens": 4,
                                               "tail_backoff_proposals": 2}}
  staged = path.with_suffix(".json.tmp")
  staged.write_text(json.dumps(manifest, indent=1))
  staged.replace(path)
  return pathlib.Path(package_dir)


def composite_copy(package_dir: str | pathlib.Path, out_dir: str | pathlib.Path, **kwargs
                   ) -> pathlib.Path:
  """A copy of a v1 package in `out_dir` with `declare_composite` applied."""
  shutil.copytree(package_dir, out_dir)
  return declare_composite(out_dir, **kwargs)


def composite_package(gguf: str | pathlib.Path, out_dir: str | pathlib.Path, **kwargs
                      ) -> pathlib.Path:
  """A v1 package of `gguf` (which has a NextN block) with `declare_composite` applied."""
  writer.split_gguf(gguf, out_dir, model_id="test/composite", generation_format="proposers")
  return declare_composite(out_dir, **kwargs)
