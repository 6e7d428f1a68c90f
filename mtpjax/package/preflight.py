"""Preflight: check a layer package without loading weights, as one JSON report.

The report schema and issue codes are docs/LAYER_PACKAGES.md §7.

`python -m mtpjax.package.preflight PKG [--stages N] [--verify-sha]` prints the report and exits
0 when it is valid, 1 otherwise. Every problem is reported as an issue, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from mtpjax import errors
from mtpjax.package import integrity, manifest as manifest_lib, planning
from mtpjax.package.issues import errors_of, is_int, issue

REPORT_SCHEMA_VERSION = 1
_STRATEGY_ECHO_FIELDS = ("type", "prediction_depth", "layer_indices", "window_policy")
_STRATEGY_OPTIONAL_ECHO_FIELDS = ("proposer", "primary", "extender", "extension_policy")
_PROPOSER_ECHO_FIELDS = ("type", "prediction_depth", "layer_indices", "ngram_min", "ngram_max",
                         "max_proposal_tokens", "history_scope")


def _artifact_entries(raw: dict) -> list[tuple[str, str, int | None, dict]]:
  """(report role, issue role, layer index, entry) for every well-formed-enough artifact entry."""
  found = []
  shared = raw.get("shared") if isinstance(raw.get("shared"), dict) else {}
  for role in manifest_lib.SHARED_ROLES:
    if isinstance(shared.get(role), dict):
      found.append((role, role, None, shared[role]))
  for entry in raw.get("layers") if isinstance(raw.get("layers"), list) else []:
    if isinstance(entry, dict):
      index = entry.get("layer_index") if is_int(entry.get("layer_index")) else None
      found.append(("layer", f"layer {index}", index, entry))
  for entry in raw.get("projectors") if isinstance(raw.get("projectors"), list) else []:
    if isinstance(entry, dict):
      found.append(("projector", "mmproj projector", None, entry))
  return found


def _check_artifacts(root: pathlib.Path, entries: list[tuple[str, str, int | None, dict]],
                     check_sha: bool
                     ) -> tuple[list[dict], list[dict], dict[str, tuple[int, bool]]]:
  """(artifact reports, new issues, part label -> (declared bytes, present)).

  Entries with an unsafe path are not touched on disk; manifest validation reports them.
  """
  reports, found, parts = [], [], {}
  for report_role, issue_role, index, entry in entries:
    path = entry.get("path")
    if integrity.unsafe_path_reason(path) or integrity.escape_reason(root, path):
      continue
    declared = entry.get("artifact_bytes")
    declared = declared if is_int(declared) and declared > 0 else None
    check = integrity.inspect_part(root, path, role=issue_role, artifact_bytes=declared,
                                   sha256=entry.get("sha256"), check_sha=check_sha)
    report = {"role": report_role}
    if index is not None:
      report["layer_index"] = index
    report.update({"path": path, "present": check.present,
                   "declared_artifact_bytes": declared or 0})
    if check.actual_bytes is not None:
      report["actual_artifact_bytes"] = check.actual_bytes
    if check.size_matches is not None:
      report["size_matches_manifest"] = check.size_matches
    if check_sha and check.present:
      report["sha256_matches_manifest"] = bool(check.sha256_matches)
    reports.append(report)
    if check.issue is not None:
      found.append(check.issue)
    label = report_role if index is None else f"layer:{index}"
    if report_role != "projector":
      parts.setdefault(label, (declared or 0, check.present))
  return reports, found, parts


def _stage_reports(layer_count: int | None, stages: object,
                   parts: dict[str, tuple[int, bool]]) -> tuple[list[dict], list[dict]]:
  """Stage plans with the parts each stage opens (§4), or the issue that prevents planning."""
  if not is_int(stages) or stages <= 0:
    return [], [issue("invalid_stage_count", "--stages must be greater than zero")]
  if layer_count is None:
    return [], []
  try:
    plan = planning.plan_stages(layer_count, stages)
  except errors.PlanningError as error:
    return [], [issue(error.code, error.message)]
  reports = []
  for stage in plan:
    labels = ["metadata"] + (["embeddings"] if stage.includes_embeddings else [])
    labels += [f"layer:{index}" for index in range(stage.layer_start, stage.layer_end)]
    labels += ["output"] if stage.includes_output else []
    reports.append({
        "stage_index": stage.stage_index, "layer_start": stage.layer_start,
        "layer_end": stage.layer_end, "includes_embeddings": stage.includes_embeddings,
        "includes_output": stage.includes_output, "part_count": len(labels),
        "artifact_bytes": sum(parts.get(label, (0, False))[0] for label in labels),
        "parts": labels,
        "missing_parts": [label for label in labels if not parts.get(label, (0, False))[1]]})
  return reports, []


def _present(body: dict, fields: tuple[str, ...]) -> dict:
  return {field: body[field] for field in fields if body.get(field) is not None}


def _generation_echo(generation: object) -> object:
  """The package's speculative defaults as operators read them: proposers and strategies as
  arrays; the era-specific fields appear only when the package sets them."""
  if not isinstance(generation, dict):
    return generation
  speculative = generation.get("speculative_decoding")
  if not isinstance(speculative, dict):
    return {"speculative_decoding": speculative}
  echo: dict = {"default": speculative.get("default")}
  proposers = speculative.get("proposers")
  if isinstance(proposers, dict) and proposers:
    echo["proposers"] = [{"name": name, **_present(body, _PROPOSER_ECHO_FIELDS)}
                         if isinstance(body, dict) else {"name": name}
                         for name, body in proposers.items()]
  strategies = speculative.get("strategies")
  echo["strategies"] = []
  for name, body in (strategies.items() if isinstance(strategies, dict) else ()):
    body = body if isinstance(body, dict) else {}
    echo["strategies"].append({"name": name,
                               **{field: body.get(field) for field in _STRATEGY_ECHO_FIELDS},
                               **_present(body, _STRATEGY_OPTIONAL_ECHO_FIELDS)})
  return {"speculative_decoding": echo}


def _v2_entries(manifest: manifest_lib.Manifest) -> list[tuple[str, str, int | None, dict]]:
  """A parsed v2 package's artifacts as `_artifact_entries` gives v1's: the carrier as
  `metadata`, the payloads owning the embeddings and the output under those roles (one common
  artifact takes the first), other non-layer payloads as `shared`."""
  def entry(artifact: manifest_lib.Artifact) -> dict:
    return {"path": artifact.path, "artifact_bytes": artifact.artifact_bytes,
            "sha256": artifact.sha256}
  found = [("metadata", "metadata carrier", None, entry(manifest.shared_metadata))]
  for artifact in manifest.payloads:
    if artifact.role == "layer":
      found.append(("layer", f"layer {artifact.layer_index}", artifact.layer_index,
                    entry(artifact)))
    else:
      role = ("embeddings" if artifact is manifest.shared_embeddings else
              "output" if artifact is manifest.shared_output else "shared")
      found.append((role, f"{role} ({artifact.label})", None, entry(artifact)))
  found += [("projector", "mmproj projector", None, entry(projector))
            for projector in manifest.projectors]
  return found


def preflight(package_dir: str | pathlib.Path, *, stages: int | None = None,
              check_sha: bool = False) -> dict:
  """The §7 report for a package directory; `valid` is false iff an issue is an error."""
  root = pathlib.Path(package_dir)
  found: list[dict] = []
  artifacts: list[dict] = []
  stage_reports: list[dict] = []
  digest = raw = v2 = None
  try:
    data = integrity.read_manifest_bytes(root, manifest_lib.MANIFEST_NAME)
  except integrity.ManifestUnreadable as unreadable:
    found.append(unreadable.record)
  else:
    digest = manifest_lib.manifest_sha256(data)
    raw, record = manifest_lib.decode_manifest_bytes(data)
    if record is not None:
      found.append(record)
    elif isinstance(raw, dict) and raw.get("schema_version") == 2:
      v2, more = manifest_lib.check_v2(raw, root)     # the carrier is read once for both
      found.extend(more)
    else:
      found.extend(manifest_lib.manifest_issues(raw, root))
  usable = isinstance(raw, dict) and (raw.get("schema_version") == 1 or v2 is not None)
  fields = {"model_id": None, "layer_count": None, "activation_width": None}
  if usable:
    fields["model_id"] = raw.get("model_id") if isinstance(raw.get("model_id"), str) else None
    for field in ("layer_count", "activation_width"):
      fields[field] = raw.get(field) if is_int(raw.get(field)) and raw[field] > 0 else None
    if v2 is not None:
      values = {item.key: item.value for item in v2.carrier_key_values}
      fields["activation_width"] = values.get(f"{values.get('general.architecture')}"
                                              ".embedding_length")
    artifacts, file_issues, parts = _check_artifacts(
        root, _artifact_entries(raw) if v2 is None else _v2_entries(v2), check_sha)
    found.extend(file_issues)
    if v2 is not None and "output" not in parts:    # one common artifact owns both boundaries
      parts["output"] = parts["embeddings"]
    plan_layers = fields["layer_count"]
    listed = raw["layers"] if v2 is None and isinstance(raw.get("layers"), list) else (
        v2.layers if v2 is not None else [])
    if plan_layers is not None and plan_layers > len(listed):
      plan_layers = None   # missing layers are reported above; a plan would be as big as the claim
    if stages is not None:
      stage_reports, stage_issues = _stage_reports(plan_layers, stages, parts)
      found.extend(stage_issues)
  report: dict = {"schema_version": REPORT_SCHEMA_VERSION, "package_path": str(root),
                  "valid": not errors_of(found), **fields}
  if usable and raw.get("generation") is not None:
    report["generation"] = _generation_echo(raw["generation"])
  report.update({
      "manifest_sha256": digest, "checked_artifact_count": len(artifacts),
      "missing_artifact_count": sum(1 for item in artifacts if not item["present"]),
      "issue_count": len(found), "issues": found, "artifacts": artifacts,
      "stages": stage_reports})
  return report


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m mtpjax.package.preflight",
                                   description="Check a layer package without loading weights.")
  parser.add_argument("package", help="layer-package directory (holds model-package.json)")
  parser.add_argument("--stages", type=int, default=None,
                      help="also plan an even split into this many pipeline stages")
  parser.add_argument("--verify-sha", "--verify_sha", "--check-sha", "--check_sha",
                      dest="check_sha", action="store_true",
                      help="hash every artifact and compare with the manifest")
  args = parser.parse_args(argv)
  report = preflight(args.package, stages=args.stages, check_sha=args.check_sha)
  print(json.dumps(report, indent=2))
  return 0 if report["valid"] else 1


if __name__ == "__main__":
  sys.exit(main())
