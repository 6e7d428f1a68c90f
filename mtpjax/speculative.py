"""Speculative strategy resolution: is native MTP (one NextN draft per step) on for this model?

Pure on purpose (no JAX, no file I/O): config + manifest + GGUF metadata go in, one frozen
`SpeculativeResolution` comes out, and every consumer reads its single `native_mtp` flag
(../shared/design/SPECULATIVE.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable, Mapping

from absl import logging

from mtpjax import draft_window
from mtpjax.draft_window import DraftWindow
from mtpjax.errors import PackageError, SpeculativeConfigError
from mtpjax.package.manifest import Manifest, SpeculativeDecoding, WindowPolicy

AUTO = "auto"
NATIVE_MTP_N1 = "native-mtp-n1"
DISABLED = "disabled"
_ALIASES = {AUTO: AUTO, NATIVE_MTP_N1: NATIVE_MTP_N1, "mtp": NATIVE_MTP_N1, DISABLED: DISABLED}
# Package strategy ids that mean native MTP n=1; upstream renamed the first to the second.
_NAMED_IDS = (NATIVE_MTP_N1, "mtp")
NATIVE_MTP_TYPE = "native-mtp"     # the only package strategy type mtpjax acts on

PACKAGE = "package"
DIRECT_GGUF_KINDS = ("gguf", "split-gguf")
BUILTIN_SCOPE = "built-in default"

ENV_VAR = "MTPJAX_NATIVE_MTP"
_ENV_TRUE = ("1", "true", "on", "yes", "enabled")
_ENV_FALSE = ("0", "false", "off", "no", "disabled")

# The tensors that make a layer a usable NextN block (MODEL.md §7).
REQUIRED_NEXTN_TENSORS = ("eh_proj", "enorm", "hnorm")
_NEXTN_NAME = re.compile(r"^blk\.([0-9]+)\.nextn\.")
_RESPLIT = "re-split the source GGUF with `python -m mtpjax.package.split`"


def normalize_strategy(value: Any, path: str) -> str:
  """Canonical strategy for a config value; config validation and resolution both call this."""
  text = value.strip().lower() if isinstance(value, str) else None
  if text == "":
    raise SpeculativeConfigError(
        f"{path} must not be empty when set", field=path,
        remedy="leave it unset for the built-in auto, or set auto, native-mtp-n1 or disabled")
  if text not in _ALIASES:
    raise SpeculativeConfigError(
        f"{path} must be one of: auto, native-mtp-n1, disabled (alias: mtp); got {value!r}",
        field=path, remedy="use one of the listed values")
  return _ALIASES[text]


@dataclasses.dataclass(frozen=True)
class SpeculativeResolution:
  """The startup decision; `native_mtp` is the effective flag (resolved AND the kill switch)."""
  model_id: str
  requested: str
  scope: str
  native_mtp: bool
  mtp_layer_index: int | None
  window_policy: dict | None
  disabled_by_env: bool
  reason: str
  draft_window: DraftWindow = DraftWindow()    # tokens a step drafts (draft_window.py)


def env_allows_native_mtp(env: Mapping[str, str] | None = None) -> bool:
  """Reads the `MTPJAX_NATIVE_MTP` kill switch; it can only turn MTP off, never on."""
  env = os.environ if env is None else env
  raw = env.get(ENV_VAR)
  text = "" if raw is None else raw.strip().lower()
  if text == "" or text in _ENV_TRUE:
    return True
  if text in _ENV_FALSE:
    return False
  raise SpeculativeConfigError(
      f"{ENV_VAR} must be one of {', '.join(_ENV_TRUE + _ENV_FALSE)} (or unset); got {raw!r}",
      field=ENV_VAR, remedy=f"unset {ENV_VAR}, or set it to 0 to turn native MTP off everywhere")


@dataclasses.dataclass(frozen=True)
class _Candidate:
  """A package strategy as native MTP sees it, after following a `proposer` reference."""
  flaw: str                    # why it cannot enable native MTP; "" when it qualifies
  layer_indices: tuple[int, ...]
  window_policy: WindowPolicy | None
  name: str = ""               # the strategy id


def _candidate(sd: SpeculativeDecoding, name: str) -> _Candidate | None:
  strategy = sd.strategies.get(name)
  if strategy is None:
    return None
  kind, depth, layers = strategy.type, strategy.prediction_depth, tuple(strategy.layer_indices)
  via = ""
  if strategy.proposer is not None:
    proposer = sd.proposers.get(strategy.proposer)
    if proposer is None:
      return _Candidate(f'proposer "{strategy.proposer}" is not declared', (),
                        strategy.window_policy)
    kind, depth, layers = proposer.type, proposer.prediction_depth, tuple(proposer.layer_indices)
    via = f' (from proposer "{strategy.proposer}")'
  if kind != NATIVE_MTP_TYPE:
    flaw = f"type {kind}"
  elif depth != 1:
    flaw = f"prediction_depth {'absent' if depth is None else depth}"
  elif not layers:
    flaw = "no layer_indices"
  else:
    return _Candidate("", layers, strategy.window_policy, name)
  return _Candidate(flaw + via, layers, strategy.window_policy, name)


def _package_default(sd: SpeculativeDecoding) -> tuple[_Candidate | None, str]:
  """PKG_DEFAULT: the package's recommended strategy, and a summary of what it advertises."""
  candidate = _candidate(sd, sd.default)
  if candidate is None:
    return None, f'default "{sd.default}" (not a declared strategy)'
  if candidate.flaw:
    return None, f'default "{sd.default}" ({candidate.flaw})'
  return candidate, f'default "{sd.default}" (native-mtp, prediction_depth 1)'


def _package_named(sd: SpeculativeDecoding) -> tuple[_Candidate | None, str]:
  """PKG_NAMED: strategy `native-mtp-n1`, else `mtp`; the exact id is looked up first."""
  for name in _NAMED_IDS:
    candidate = _candidate(sd, name)
    if candidate is not None:
      if candidate.flaw:
        return None, f'strategy "{name}" with {candidate.flaw}'
      return candidate, f'strategy "{name}" (native-mtp, prediction_depth 1)'
  default = _candidate(sd, sd.default)
  what = "not a declared strategy" if default is None else (default.flaw or "type native-mtp")
  return None, f'no strategy named native-mtp-n1 or mtp (default "{sd.default}", {what})'


def _nextn_layers(tensor_names: Iterable[str]) -> dict[int, set[str]]:
  """Layer index -> NextN tensor names found in that layer."""
  layers: dict[int, set[str]] = {}
  for name in tensor_names:
    match = _NEXTN_NAME.match(name)
    if match:
      layers.setdefault(int(match.group(1)), set()).add(name)
  return layers


def _gguf_nextn_count(gguf_metadata: Mapping[str, Any]) -> tuple[str, int | None]:
  """The `{arch}.nextn_predict_layers` key (or any key with that suffix) and its integer value."""
  arch = str(gguf_metadata.get("general.architecture", "general.architecture-absent"))
  key = f"{arch}.nextn_predict_layers"
  if key not in gguf_metadata:
    others = sorted(k for k in gguf_metadata if str(k).endswith(".nextn_predict_layers"))
    if not others:
      return key, None
    key = others[0]
  try:
    return key, int(gguf_metadata[key])
  except (TypeError, ValueError):
    return key, None


def _check_nextn_block(model_id: str, source_path: str | None, advertised: tuple[int, ...],
                       nextn: dict[int, set[str]], layer_count: int) -> int:
  """Loading a model that resolved to MTP on: exactly one NextN block, the last layer, complete."""
  last = layer_count - 1
  remedy = f"{_RESPLIT} from a GGUF with the NextN head, or set speculative.strategy to disabled"
  layers = sorted(set(advertised) | set(nextn))
  if layers != [last]:
    raise PackageError(
        f"model {model_id}: native MTP needs exactly one NextN block at the last layer "
        f"({last} of layer_count {layer_count}); the model has NextN layers {layers}",
        path=source_path, remedy=remedy,
        field="generation.speculative_decoding layer_indices" if advertised else "blk.N.nextn.*")
  present = nextn.get(last, set())
  for part in REQUIRED_NEXTN_TENSORS:
    tensor = f"blk.{last}.nextn.{part}.weight"
    if tensor not in present:
      raise PackageError(
          f"model {model_id}: native MTP is advertised at layer {last}, but tensor {tensor} "
          "is missing", path=source_path, field=tensor, remedy=remedy)
  return last


def _policy_dict(policy: WindowPolicy | None) -> dict | None:
  return None if policy is None else dataclasses.asdict(policy)


def _note_window_policy(model_id: str, policy: WindowPolicy | None, window: DraftWindow) -> None:
  """Say once, at startup, which window mtpjax drafts with when it differs from the policy."""
  if policy is None:
    return
  if (policy.default == "adaptive", policy.initial_window, policy.min_window,
      policy.max_window) != (window.adaptive, window.initial, window.min, window.max):
    logging.info("model %s: the package advertises window policy %s; mtpjax drafts with %s",
                 model_id, dataclasses.asdict(policy), window.as_dict())


@dataclasses.dataclass(frozen=True)
class _Verdict:
  """What the model supports for the requested strategy, before the kill switch."""
  on: bool
  reason: str
  advertised: tuple[int, ...] = ()
  policy: WindowPolicy | None = None
  strategy_id: str | None = None


def _package_verdict(canonical: str, scope: str, model_id: str, source_path: str | None,
                     manifest: Manifest) -> _Verdict:
  generation = manifest.generation
  sd = None if generation is None else generation.speculative_decoding
  if generation is None:
    candidate, summary = None, "no generation block"
  elif sd is None:
    candidate, summary = None, "no speculative_decoding block"
  else:
    candidate, summary = (_package_default if canonical == AUTO else _package_named)(sd)
  if candidate is not None:
    return _Verdict(True, f"{canonical} (from {scope}): the package advertises {summary}",
                    candidate.layer_indices, candidate.window_policy, candidate.name)
  if canonical == AUTO:
    return _Verdict(False, f"auto (from {scope}): the package advertises {summary}, so native "
                    "MTP stays off")
  raise SpeculativeConfigError(
      f'model {model_id}: speculative.strategy = "native-mtp-n1" requires package generation '
      f"metadata advertising native-mtp-n1; the package advertises {summary} (from {scope}). "
      f"Remedy: set the strategy to auto or disabled, or {_RESPLIT}.",
      path=source_path, field=scope)


def _gguf_verdict(canonical: str, scope: str, model_id: str, source_path: str | None,
                  gguf_metadata: Mapping[str, Any], nextn: dict[int, set[str]]) -> _Verdict:
  """GGUF_PROOF needs metadata AND tensors: either alone has shipped without a usable head."""
  key, count = _gguf_nextn_count(gguf_metadata)
  tensor_count = sum(len(found) for found in nextn.values())
  evidence = (f"{key} = {'absent' if count is None else count}, "
              f"{tensor_count} blk.N.nextn.* tensors found")
  if canonical == AUTO:
    return _Verdict(False, f"auto (from {scope}): a direct GGUF carries no publisher "
                    f"recommendation, so native MTP stays off ({evidence}); set the strategy to "
                    "native-mtp-n1 to opt in")
  if count is None or count <= 0 or tensor_count == 0:
    raise SpeculativeConfigError(
        f'model {source_path or model_id}: speculative.strategy = "native-mtp-n1" requires '
        f"proven native-mtp-n1 support: {evidence}.", path=source_path, field=scope,
        remedy="use a GGUF that includes the NextN (MTP) head, or set the strategy to auto or "
               "disabled")
  if count != 1:
    raise PackageError(
        f"model {model_id}: {key} = {count}, but mtpjax supports exactly one NextN block",
        path=source_path, field=key, remedy="set speculative.strategy to disabled")
  return _Verdict(True, f"native-mtp-n1 (from {scope}): the GGUF proves a NextN head ({evidence})")


def resolve_speculative(*, model_id: str, requested: str | None, scope: str, source_kind: str,
                        manifest: Manifest | None, layer_count: int,
                        gguf_metadata: Mapping[str, Any], tensor_names: Iterable[str],
                        env: Mapping[str, str] | None = None,
                        source_path: str | None = None, max_draft_tokens: int | None = None,
                        max_draft_tokens_field: str = "speculative.max_draft_tokens"
                        ) -> SpeculativeResolution:
  """Applies the SPECULATIVE.md §4 matrix, the on-consistency check and the §5 kill switch,
  and the draft window (`draft_window.resolve_window`; `max_draft_tokens` from the config
  field `max_draft_tokens_field`).

  `requested` None means nothing was set (built-in auto). `source_path` only enriches errors.
  """
  draft_window.check_max_draft_tokens(max_draft_tokens, max_draft_tokens_field)
  if source_kind != PACKAGE and source_kind not in DIRECT_GGUF_KINDS:
    raise ValueError(f"source_kind must be package, gguf or split-gguf; got {source_kind!r}")
  if source_kind == PACKAGE and manifest is None:
    raise ValueError("a package source needs its manifest")
  canonical = AUTO if requested is None else normalize_strategy(requested, scope)
  nextn = _nextn_layers(tensor_names)
  if canonical == DISABLED:
    verdict = _Verdict(False, f'speculative.strategy = "disabled" (from {scope})')
  elif source_kind == PACKAGE:
    verdict = _package_verdict(canonical, scope, model_id, source_path, manifest)
  else:
    verdict = _gguf_verdict(canonical, scope, model_id, source_path, gguf_metadata, nextn)
  layer_index = None
  if verdict.on:
    layer_index = _check_nextn_block(model_id, source_path, verdict.advertised, nextn,
                                     layer_count)
  # The switch is read after resolution, so a bad configuration still fails loudly when it is off.
  allows = env_allows_native_mtp(env)
  effective = verdict.on and allows
  window = DraftWindow()
  if verdict.on:
    window = draft_window.resolve_window(verdict.strategy_id, verdict.policy, max_draft_tokens,
                                         max_draft_tokens_field, model_id)
  if effective:
    _note_window_policy(model_id, verdict.policy, window)
  reason = verdict.reason if allows else f"{verdict.reason}; {ENV_VAR} turns native MTP off"
  return SpeculativeResolution(
      model_id=model_id, requested=canonical, scope=scope, native_mtp=effective,
      mtp_layer_index=layer_index if effective else None,
      window_policy=_policy_dict(verdict.policy) if effective else None,
      disabled_by_env=not allows, reason=reason,
      draft_window=window if effective else DraftWindow())


def _config_value(config: Any, keys: tuple[str, ...]) -> Any:
  """`config.a.b.c`, or None when a group along the way does not exist."""
  node = config
  for key in keys:
    try:
      node = node[key]
    except (KeyError, TypeError, AttributeError):
      return None
  return node


def strategy_from_config(config: Any, model_name: str) -> tuple[str, str]:
  """(canonical strategy, scope): per-model beats defaults beats the built-in auto.

  Every value that is set is validated, even one that a higher scope overrides, so a typo fails
  at startup rather than after the per-model override is removed.
  """
  model_scope = f"models.{model_name}.speculative.strategy"
  default_scope = "defaults.speculative.strategy"
  per_model = _config_value(config, ("models", model_name, "speculative", "strategy"))
  defaults = _config_value(config, ("defaults", "speculative", "strategy"))
  default_value = None if defaults is None else normalize_strategy(defaults, default_scope)
  if per_model is not None:
    return normalize_strategy(per_model, model_scope), model_scope
  if default_value is not None:
    return default_value, default_scope
  return AUTO, BUILTIN_SCOPE


def max_draft_tokens_from_config(config: Any, model_name: str) -> tuple[int | None, str]:
  """(`speculative.max_draft_tokens`, its field): per-model beats defaults; every value that is
  set is checked (`draft_window.check_max_draft_tokens`), as `strategy_from_config` does."""
  found = [(draft_window.check_max_draft_tokens(_config_value(config, keys), field), field)
           for keys, field in (
               (("models", model_name, "speculative", "max_draft_tokens"),
                f"models.{model_name}.speculative.max_draft_tokens"),
               (("defaults", "speculative", "max_draft_tokens"),
                "defaults.speculative.max_draft_tokens"))]
  return next(((value, field) for value, field in found if value is not None), found[-1])


def resolve_for_source(config: Any, model_name: str, source: Any,
                       env: Mapping[str, str] | None = None) -> SpeculativeResolution:
  """Resolution for an opened source (kind, manifest, metadata, tensors, layer_count, path)."""
  requested, scope = strategy_from_config(config, model_name)
  max_draft_tokens, field = max_draft_tokens_from_config(config, model_name)
  manifest = source.manifest
  path = None if source.path is None else str(source.path)
  model_id = manifest.model_id if manifest is not None else (path or model_name)
  return resolve_speculative(
      model_id=model_id, requested=requested, scope=scope, source_kind=source.kind,
      manifest=manifest, layer_count=source.layer_count, gguf_metadata=source.metadata,
      tensor_names=source.tensors.keys(), env=env, source_path=path,
      max_draft_tokens=max_draft_tokens, max_draft_tokens_field=field)
