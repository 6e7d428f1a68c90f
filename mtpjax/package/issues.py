"""Preflight issues: the one record shape that manifest validation, the reader and preflight share.

An issue is a plain dict `{severity, code, message, path?, remediation}` (docs/LAYER_PACKAGES.md §7),
so preflight can print it as JSON and `ManifestError.issues` can carry it unchanged.
"""

from __future__ import annotations

ERROR = "error"
WARNING = "warning"

_RESPLIT = "re-split the source GGUF with `python -m mtpjax.package.split`"

# One remedy per code, so every producer of an issue gives the same advice.
REMEDIES: dict[str, str] = {
    "missing_manifest": "point at a layer-package directory that contains model-package.json, "
                        "or create one with `python -m mtpjax.package.split`",
    "invalid_manifest_json": "repair model-package.json (it must be a UTF-8 JSON object) or "
                             + _RESPLIT,
    "unsupported_schema_version": "mtpjax reads manifest schema_version 1 and 2; " + _RESPLIT,
    "invalid_format": 'set "format": "layer-package" or ' + _RESPLIT,
    "empty_model_id": 'set "model_id" to a model coordinate such as "org/repo:Q4_K_M"',
    "invalid_layer_count": "set layer_count to max(block index)+1 of the source (NextN block "
                           "included)",
    "invalid_activation_width": "set activation_width to the source's {arch}.embedding_length",
    "missing_activation_width": "add activation_width ({arch}.embedding_length); until then "
                                "readers infer it from layer 0's attn_norm.weight",
    "empty_source_model_path": "record the source GGUF path in source_model.path, or " + _RESPLIT,
    "invalid_source_model_sha256": "record the source GGUF's 64-hex SHA-256 in source_model.sha256",
    "empty_source_model_identity": "remove blank source_model identity fields or fill them in",
    "invalid_source_model_file": "give every source_model.files[] entry a non-blank path, a "
                                 "non-negative size_bytes and a 64-hex sha256",
    "missing_skippy_abi_version": 'set "skippy_abi_version" (our writer stamps "0.1.0")',
    "incompatible_skippy_abi_version": "upgrade mtpjax or " + _RESPLIT,
    "empty_projector_kind": 'set the projector "kind" to "mmproj"',
    "unsupported_projector_kind": 'mtpjax only loads projectors of kind "mmproj"; remove the '
                                  "others",
    "invalid_generation": "make generation.speculative_decoding an object, or remove the block",
    "empty_speculative_default": "set speculative_decoding.default to one of the strategy ids",
    "missing_speculative_default_strategy": "make speculative_decoding.default a key of strategies",
    "empty_speculative_strategy_name": "give every speculative strategy a non-empty id",
    "empty_speculative_strategy_type": 'give every speculative strategy a "type" such as '
                                       '"native-mtp"',
    "missing_speculative_proposer": "add the named proposer to speculative_decoding.proposers",
    "unsupported_speculative_strategy_type": "nothing to do unless you want this strategy: mtpjax "
                                             "runs native-mtp, ngram-simple, ngram-cache, "
                                             "ngram-suffix and composite strategies and ignores "
                                             "other types",
    "empty_speculative_proposer_name": "give every speculative proposer a non-empty id such as "
                                       "mtp or ngram-cache",
    "unsupported_speculative_proposer_type": "use a proposer type mtpjax runs (native-mtp, "
                                             "ngram-simple, ngram-cache, ngram-suffix); others are "
                                             "ignored and no strategy may use them",
    "native_mtp_strategy_proposer_type_mismatch": "point the native-mtp strategy's proposer at a "
                                                  "native-mtp proposer",
    "missing_ngram_strategy_proposer": "name the strategy's n-gram proposer in its proposer field",
    "ngram_strategy_proposer_type_mismatch": "make the n-gram strategy's type equal to its "
                                             "proposer's type",
    "missing_composite_primary": "set primary to a declared native-mtp proposer",
    "missing_composite_extender": "set extender to a declared ngram-simple, ngram-cache or "
                                  "ngram-suffix proposer",
    "missing_composite_extension_policy": "add extension_policy with max_tokens (initial_tokens "
                                          "and tail_backoff_proposals are optional)",
    "invalid_composite_primary_type": "set primary to a native-mtp proposer",
    "invalid_composite_extender_type": "set extender to an ngram-simple, ngram-cache or "
                                       "ngram-suffix proposer",
    "invalid_extension_policy_tokens": "extension_policy needs max_tokens >= 1, 1 <= "
                                       "initial_tokens <= max_tokens and tail_backoff_proposals "
                                       ">= 0",
    "invalid_ngram_proposer_window": "set integers ngram_min and ngram_max with 1 <= ngram_min <= "
                                     "ngram_max",
    "invalid_ngram_proposer_max_tokens": "set max_proposal_tokens to a positive integer",
    "unsupported_ngram_cache_max_window": "set ngram_max to at most 4 for ngram-cache "
                                          "(max_proposal_tokens stays independent), or use "
                                          "ngram-suffix for longer matches",
    "invalid_ngram_cache_history_scope": 'set history_scope to "request": n-gram history is '
                                         "never shared between requests",
    "unsupported_ngram_suffix_window": "ngram-suffix needs 3 <= ngram_min <= ngram_max <= 64",
    "invalid_ngram_suffix_history_scope": 'set history_scope to "request": suffix indexes are '
                                          "per request",
    "invalid_window_policy_pipeline_depth": "set window_policy.pipeline_depth to an integer from "
                                            "1 to 64, or remove it",
    "unsupported_native_mtp_prediction_depth": "mtpjax drafts one token: set prediction_depth 1",
    "missing_native_mtp_layers": "list the NextN block's package layer index in layer_indices",
    "native_mtp_layer_out_of_range": "layer_indices must name package layers below layer_count; "
                                     + _RESPLIT,
    "empty_window_policy_default": 'set window_policy.default to "fixed" or "adaptive"',
    "invalid_window_policy_zero": "window_policy windows must be positive integers (native MTP: "
                                  "1/1/1)",
    "invalid_window_policy_bounds": "window_policy.min_window must not exceed max_window",
    "invalid_window_policy_initial": "window_policy.initial_window must lie in [min_window, "
                                     "max_window]",
    "layer_index_out_of_range": "layers[].layer_index must be in 0..layer_count-1; " + _RESPLIT,
    "missing_layer": "add the missing layer artifact, or " + _RESPLIT,
    "duplicate_layer": "keep exactly one layers[] entry per layer index; " + _RESPLIT,
    "unsafe_artifact_path": "artifact paths must be relative, use '/', have no '.'/'..' components "
                            "and must not leave the package through a symlink",
    "artifact_not_file": "replace the path with a regular file (re-download the package)",
    "manifest_not_file": "make model-package.json a regular file (not a FIFO, device or "
                         "directory): re-download the package or " + _RESPLIT,
    "unsafe_manifest_path": "make model-package.json a file inside the package, not a symlink "
                            "leaving it: re-download the package or " + _RESPLIT,
    "missing_artifact": "re-download the package or " + _RESPLIT,
    "artifact_size_mismatch": "the file is truncated or replaced: re-download it or " + _RESPLIT,
    "empty_artifact": "artifact_bytes must be the (positive) file size; " + _RESPLIT,
    "invalid_tensor_bytes": "tensor_count/tensor_bytes must describe the fragment; " + _RESPLIT,
    "invalid_artifact_sha256": "record the artifact's 64-hex SHA-256 in the manifest",
    "artifact_sha256_mismatch": "the file is corrupt: re-download it or " + _RESPLIT,
    "artifact_trailing_bytes": "the file has bytes its GGUF header does not describe (appended "
                               "or padded): re-download it or " + _RESPLIT,
    "artifact_sha256_unreadable": "make the file readable (permissions, I/O errors) and retry",
    # schema v2 (docs/LAYER_PACKAGES.md §10; codes are upstream's, the first two ours)
    "unknown_field": "schema v2 rejects fields it does not define: remove the field, or "
                     + _RESPLIT + " --schema-version 2",
    "invalid_field_type": "give the field the type and range schema v2 defines",
    "missing_value": "fill in the required, non-blank value",
    "invalid_digest": "write digests as 64 lowercase hex digits (package_id as sha256:<hex>)",
    "invalid_identifier": "artifact ids use only letters, digits, '-', '_' and '.'",
    "invalid_path": "paths must be normalized relative package paths ('/'-separated, no '.', "
                    "'..', '//', backslash or trailing '/') that stay inside the package",
    "unknown_source_file": "list source_model.primary_file in source_model.files",
    "source_identity_mismatch": "source_model.sha256 must equal the primary source file's sha256",
    "invalid_metadata_artifact": "point source_model.metadata_artifact_id at the package's "
                                 "payload-free carrier GGUF (re-download it if it is corrupt), "
                                 "or " + _RESPLIT + " --schema-version 2",
    "duplicate_artifact": "give every artifact a distinct id",
    "duplicate_artifact_path": "give every artifact a distinct path",
    "duplicate_sidecar": "give each projector sidecar a distinct name",
    "unknown_artifact": "reference only artifact ids (and payload parts) the catalog declares",
    "layer_out_of_bounds": "layer ordinals must be below layer_count; " + _RESPLIT,
    "invalid_alignment": "tensor alignments must be non-zero powers of two; " + _RESPLIT,
    "misaligned_offset": "tensor offsets must be multiples of their alignment; " + _RESPLIT,
    "storage_out_of_bounds": "the carrier's tensor ranges must lie inside their artifact; the "
                             "package is corrupt: re-download it or " + _RESPLIT,
    "invalid_stored_length": "stored lengths must be the tensors' byte sizes; " + _RESPLIT,
    "overlapping_storage": "tensor byte ranges in one artifact must not overlap; " + _RESPLIT,
    "package_identity_mismatch": "package_id must be the canonical identity of the root: the "
                                 "root was edited after it was written; re-download it or "
                                 + _RESPLIT + " --schema-version 2",
    "invalid_generation_value": "use the generation types and fields schema v2 defines "
                                "(native-mtp, ngram-cache, ngram-suffix, composite)",
    "unsupported_artifact_layout": "mtpjax stages v2 packages whose payload artifacts each own "
                                   "one layer's tensors or no layer tensors; "
                                   + _RESPLIT + " --schema-version 2",
    "invalid_stage_count": "pass --stages greater than zero",
    "stage_count_exceeds_layer_count": "use at most layer_count stages",
}


def issue(code: str, message: str, *, path: str | None = None, severity: str = ERROR,
          remediation: str | None = None) -> dict:
  """Builds one issue dict; the remedy defaults to the code's entry in REMEDIES."""
  record = {"severity": severity, "code": code, "message": message}
  if path is not None:
    record["path"] = str(path)
  record["remediation"] = remediation if remediation is not None else REMEDIES.get(code, _RESPLIT)
  return record


def errors_of(issues: list[dict]) -> list[dict]:
  """The issues that make a package invalid (warnings do not)."""
  return [item for item in issues if item["severity"] == ERROR]


def is_int(value: object) -> bool:
  """A JSON integer (Python's bool is an int, but `true` is not a count)."""
  return isinstance(value, int) and not isinstance(value, bool)


def is_blank(value: object) -> bool:
  """Missing, not a string, or only whitespace."""
  return not isinstance(value, str) or not value.strip()
