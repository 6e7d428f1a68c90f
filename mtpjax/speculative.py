"""Speculative strategy resolution: what drafts for this model, native MTP, an n-gram proposer
over the request's own tokens, or both (a composite)?

Pure on purpose (no JAX, no file I/O): config + manifest + GGUF metadata go in, one frozen
`SpeculativeResolution` comes out. Every consumer reads its single `native_mtp` flag (whether
the NextN head is built and drafts) and, for n-gram drafting, its `ngram` and `extension`
settings (docs/SPECULATIVE.md).
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
from mtpjax.package import generation_rules
from mtpjax.package.manifest import (ExtensionPolicy, Manifest, Proposer, SpeculativeDecoding,
                                     Strategy, WindowPolicy)

AUTO = "auto"
NATIVE_MTP_N1 = "native-mtp-n1"
DISABLED = "disabled"
NGRAM_STRATEGIES = generation_rules.NGRAM_TYPES     # ngram-simple, ngram-cache, ngram-suffix
BUILTIN_STRATEGIES = (AUTO, NATIVE_MTP_N1, DISABLED, *NGRAM_STRATEGIES)
_ALIASES = {**{value: value for value in BUILTIN_STRATEGIES}, "mtp": NATIVE_MTP_N1}
# Any other value names a package strategy; its id is checked against the package at resolution.
_PACKAGE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VALUES = ("auto, native-mtp-n1, disabled, ngram-simple, ngram-cache, ngram-suffix (alias: mtp), "
           "or a strategy id the package declares (letters, digits, '.', '_', '-')")
# Package strategy ids that mean native MTP n=1; upstream renamed the first to the second.
_NAMED_IDS = (NATIVE_MTP_N1, "mtp")
NATIVE_MTP_TYPE = generation_rules.NATIVE_MTP_TYPE
COMPOSITE_TYPE = generation_rules.COMPOSITE_TYPE

# N-gram proposer settings when the package declares none of the requested type:
# type -> (ngram_min, ngram_max, max_proposal_tokens).
NGRAM_DEFAULTS = {
    generation_rules.NGRAM_SIMPLE_TYPE: (2, 4, 4),
    generation_rules.NGRAM_CACHE_TYPE: (2, generation_rules.NGRAM_CACHE_MAX_NGRAM, 4),
    generation_rules.NGRAM_SUFFIX_TYPE: (generation_rules.NGRAM_SUFFIX_MIN_NGRAM, 16, 8),
}
# Composite extension_policy fields newer writers leave out (upstream's runtime defaults).
DEFAULT_INITIAL_TAIL_TOKENS = 2
DEFAULT_TAIL_BACKOFF_PROPOSALS = 6

PACKAGE = "package"
DIRECT_GGUF_KINDS = ("gguf", "split-gguf")
BUILTIN_SCOPE = "built-in default"

ENV_VAR = "MTPJAX_NATIVE_MTP"
_ENV_TRUE = ("1", "true", "on", "yes", "enabled")
_ENV_FALSE = ("0", "false", "off", "no", "disabled")

# The tensors that make a layer a usable NextN block (docs/MODEL.md §7).
REQUIRED_NEXTN_TENSORS = ("eh_proj", "enorm", "hnorm")
_NEXTN_NAME = re.compile(r"^blk\.([0-9]+)\.nextn\.")
_RESPLIT = "re-split the source GGUF with `python -m mtpjax.package.split`"


def normalize_strategy(value: Any, path: str) -> str:
  """Canonical strategy for a config value; config validation and resolution both call this."""
  text = value.strip() if isinstance(value, str) else None
  if text == "":
    raise SpeculativeConfigError(
        f"{path} must not be empty when set", field=path,
        remedy="leave it unset for the built-in auto, or set auto, native-mtp-n1, disabled or "
               "an ngram-* value")
  if text is not None and text.lower() in _ALIASES:
    return _ALIASES[text.lower()]
  if text is None or not _PACKAGE_ID.fullmatch(text):
    raise SpeculativeConfigError(f"{path} must be one of: {_VALUES}; got {value!r}", field=path,
                                 remedy="use one of the listed values")
  return text


@dataclasses.dataclass(frozen=True)
class NgramSettings:
  """The n-gram proposer that drafts, alone or extending native MTP's draft."""
  type: str                    # ngram-simple | ngram-cache | ngram-suffix
  ngram_min: int
  ngram_max: int
  max_proposal_tokens: int
  source: str                  # 'package proposer "<id>"' or "built-in defaults"


@dataclasses.dataclass(frozen=True)
class ExtensionSettings:
  """A composite's n-gram tail after the MTP draft, every field filled (see engine/composite)."""
  max_tokens: int
  initial_tokens: int
  tail_backoff_proposals: int


@dataclasses.dataclass(frozen=True)
class SpeculativeResolution:
  """The startup decision; `native_mtp` is the effective flag (resolved AND the kill switch).

  `strategy_type` is what drafts: native-mtp, an ngram-* type, composite (MTP, then `ngram`
  extends within `extension`), or None when nothing does.
  """
  model_id: str
  requested: str
  scope: str
  native_mtp: bool
  mtp_layer_index: int | None
  window_policy: dict | None
  disabled_by_env: bool
  reason: str
  strategy_type: str | None = None
  strategy_id: str | None = None         # the package strategy served, when one is
  ngram: NgramSettings | None = None
  extension: ExtensionSettings | None = None
  draft_window: DraftWindow = DraftWindow()    # tokens a step drafts (draft_window.py)

  def summary(self) -> dict:
    """What drafts, for /v1/models and the startup log."""
    return {"type": self.strategy_type, "strategy_id": self.strategy_id,
            "ngram": None if self.ngram is None else dataclasses.asdict(self.ngram),
            "extension": None if self.extension is None else dataclasses.asdict(self.extension)}


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
  """A package strategy as native MTP sees it, after following a `proposer` (or a composite's
  `primary`) reference."""
  flaw: str                    # why it cannot enable native MTP; "" when it qualifies
  layer_indices: tuple[int, ...]
  window_policy: WindowPolicy | None
  name: str = ""               # the strategy id


def _candidate(sd: SpeculativeDecoding, name: str, *,
               composite_ok: bool = False) -> _Candidate | None:
  strategy = sd.strategies.get(name)
  if strategy is None:
    return None
  if strategy.type == COMPOSITE_TYPE and not composite_ok:
    return _Candidate(f"type {COMPOSITE_TYPE}", (), strategy.window_policy)
  kind, depth, layers = strategy.type, strategy.prediction_depth, tuple(strategy.layer_indices)
  via = ""
  role, reference = (("primary", strategy.primary) if strategy.type == COMPOSITE_TYPE
                     else ("proposer", strategy.proposer))
  if reference is not None:
    proposer = sd.proposers.get(reference)
    if proposer is None:
      return _Candidate(f'{role} "{reference}" is not declared', (), strategy.window_policy)
    kind, depth, layers = proposer.type, proposer.prediction_depth, tuple(proposer.layer_indices)
    via = f' (from {role} "{reference}")'
  if kind != NATIVE_MTP_TYPE:
    flaw = f"type {kind}"
  elif depth != 1:
    flaw = f"prediction_depth {'absent' if depth is None else depth}"
  elif not layers:
    flaw = "no layer_indices"
  else:
    return _Candidate("", layers, strategy.window_policy, name)
  return _Candidate(flaw + via, layers, strategy.window_policy, name)


def _advertised(strategy: Strategy) -> str:
  if strategy.type == COMPOSITE_TYPE:
    return f'composite: native-mtp, prediction_depth 1, extended by "{strategy.extender}"'
  return "native-mtp, prediction_depth 1"


def _package_default(sd: SpeculativeDecoding) -> tuple[_Candidate | None, str]:
  """PKG_DEFAULT: the package's recommended strategy, and a summary of what it advertises."""
  candidate = _candidate(sd, sd.default, composite_ok=True)
  if candidate is None:
    return None, f'default "{sd.default}" (not a declared strategy)'
  if candidate.flaw:
    return None, f'default "{sd.default}" ({candidate.flaw})'
  return candidate, f'default "{sd.default}" ({_advertised(sd.strategies[sd.default])})'


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


def _ngram_settings(kind: str, proposer: Proposer | None) -> NgramSettings:
  """A declared proposer of `kind`, else the built-in defaults for it."""
  if proposer is None or proposer.type != kind:
    return NgramSettings(kind, *NGRAM_DEFAULTS[kind], source="built-in defaults")
  return NgramSettings(kind, proposer.ngram_min, proposer.ngram_max, proposer.max_proposal_tokens,
                       source=f'package proposer "{proposer.name}"')


def _declared_ngram_proposer(sd: SpeculativeDecoding | None, kind: str) -> Proposer | None:
  """For a requested `ngram-*` value: the proposer of the package's strategy of that type (the
  default first), else any declared proposer of that type (e.g. a composite's extender)."""
  if sd is None:
    return None
  ordered = sorted(sd.strategies.values(), key=lambda strategy: strategy.name != sd.default)
  for strategy in ordered:
    proposer = sd.ngram_proposer(strategy) if strategy.type == kind else None
    if proposer is not None:
      return proposer
  return next((proposer for proposer in sd.proposers.values() if proposer.type == kind), None)


def _extension_settings(policy: ExtensionPolicy | None,
                        extender: NgramSettings) -> ExtensionSettings:
  """Fields a newer writer left out get upstream's defaults; without a policy (a hand-built
  manifest: the parser requires one) the tail may be as long as the extender proposes."""
  if policy is None:
    policy = ExtensionPolicy(max_tokens=extender.max_proposal_tokens)
  first, backoff = policy.initial_tokens, policy.tail_backoff_proposals
  return ExtensionSettings(
      max_tokens=policy.max_tokens,
      initial_tokens=min(DEFAULT_INITIAL_TAIL_TOKENS, policy.max_tokens) if first is None
      else first,
      tail_backoff_proposals=DEFAULT_TAIL_BACKOFF_PROPOSALS if backoff is None else backoff)


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
  on: bool                               # native MTP
  reason: str
  advertised: tuple[int, ...] = ()
  policy: WindowPolicy | None = None
  strategy_id: str | None = None
  ngram: NgramSettings | None = None     # the n-gram proposer, alone or as the extender
  extension: ExtensionSettings | None = None


def _ngram_strategy_verdict(reason: str, sd: SpeculativeDecoding, strategy: Strategy) -> _Verdict:
  ngram = _ngram_settings(strategy.type, sd.ngram_proposer(strategy))
  return _Verdict(False, reason, policy=strategy.window_policy, strategy_id=strategy.name,
                  ngram=ngram)


def _native_verdict(reason: str, sd: SpeculativeDecoding, name: str,
                    candidate: _Candidate) -> _Verdict:
  """Native MTP on, extended by the n-gram extender when the strategy is a composite."""
  strategy = sd.strategies[name]
  if strategy.type != COMPOSITE_TYPE:
    return _Verdict(True, reason, candidate.layer_indices, candidate.window_policy, name)
  extender = sd.proposers.get(strategy.extender)
  ngram = _ngram_settings(generation_rules.NGRAM_SIMPLE_TYPE if extender is None
                          else extender.type, extender)
  return _Verdict(True, reason, candidate.layer_indices, candidate.window_policy, name, ngram,
                  _extension_settings(strategy.extension_policy, ngram))


def _runnable(sd: SpeculativeDecoding) -> str:
  names = sorted(name for name, strategy in sd.strategies.items() if strategy.known)
  return ", ".join(names) or "none"


def _unknown_type_error(model_id: str, source_path: str | None, scope: str, what: str,
                        strategy: Strategy, sd: SpeculativeDecoding) -> SpeculativeConfigError:
  """A type mtpjax does not run is ignored, unless it is the strategy that must be served."""
  return SpeculativeConfigError(
      f'model {model_id}: {what} "{strategy.name}" has type {strategy.type}, which mtpjax does '
      f"not run (from {scope})", path=source_path, field=scope,
      remedy="set speculative.strategy to disabled, to an ngram-* value, or to one of the "
             f"package strategies mtpjax runs: {_runnable(sd)}")


def _auto_verdict(scope: str, model_id: str, source_path: str | None,
                  sd: SpeculativeDecoding) -> _Verdict:
  """`auto` serves the package default whatever it drafts with, if mtpjax runs its type."""
  strategy = sd.strategies.get(sd.default)
  if strategy is not None and not strategy.known:
    raise _unknown_type_error(model_id, source_path, scope, "the package default strategy",
                              strategy, sd)
  if strategy is not None and strategy.type in NGRAM_STRATEGIES:
    return _ngram_strategy_verdict(
        f'auto (from {scope}): the package advertises default "{sd.default}" ({strategy.type})',
        sd, strategy)
  candidate, summary = _package_default(sd)
  if candidate is None:
    return _Verdict(False, f"auto (from {scope}): the package advertises {summary}, so native "
                    "MTP stays off")
  return _native_verdict(f"auto (from {scope}): the package advertises {summary}", sd,
                         sd.default, candidate)


def _declared_strategy(sd: SpeculativeDecoding | None, requested: str) -> Strategy | None:
  """The package strategy a config value names: the exact id, else the one id equal to it
  ignoring case."""
  if sd is None:
    return None
  if requested in sd.strategies:
    return sd.strategies[requested]
  folded = [strategy for name, strategy in sd.strategies.items()
            if name.lower() == requested.lower()]
  return folded[0] if len(folded) == 1 else None


def _declared_verdict(requested: str, scope: str, model_id: str, source_path: str | None,
                      sd: SpeculativeDecoding | None) -> _Verdict:
  """A strategy id the package declares, served as its type says; anything else fails."""
  strategy = _declared_strategy(sd, requested)
  if strategy is None:
    declared = "none" if sd is None else (", ".join(sorted(sd.strategies)) or "none")
    raise SpeculativeConfigError(
        f'model {model_id}: speculative.strategy = "{requested}" is not a strategy the package '
        f"declares (declared: {declared}) (from {scope})", path=source_path, field=scope,
        remedy=f"set it to one of: {_VALUES}")
  if not strategy.known:
    raise _unknown_type_error(model_id, source_path, scope, "strategy", strategy, sd)
  reason = f'{strategy.name} (from {scope}): the package declares it'
  if strategy.type in NGRAM_STRATEGIES:
    return _ngram_strategy_verdict(f"{reason} ({strategy.type})", sd, strategy)
  candidate = _candidate(sd, strategy.name, composite_ok=True)
  if candidate.flaw:
    raise SpeculativeConfigError(
        f'model {model_id}: speculative.strategy = "{strategy.name}" requires package generation '
        f"metadata advertising native MTP for it; strategy \"{strategy.name}\" has "
        f"{candidate.flaw} (from {scope})", path=source_path, field=scope,
        remedy=f"set the strategy to auto or disabled, or {_RESPLIT}")
  return _native_verdict(f"{reason} ({_advertised(strategy)})", sd, strategy.name, candidate)


def _ngram_verdict(requested: str, scope: str, sd: SpeculativeDecoding | None) -> _Verdict:
  """`ngram-*` drafts from the request's own tokens: any model, with or without a NextN head."""
  ngram = _ngram_settings(requested, _declared_ngram_proposer(sd, requested))
  return _Verdict(False, f"{requested} (from {scope}): n-gram drafts from the request's own "
                  f"tokens ({ngram.source})", ngram=ngram)


def _speculative_block(manifest: Manifest) -> tuple[SpeculativeDecoding | None, str]:
  generation = manifest.generation
  if generation is None:
    return None, "no generation block"
  if generation.speculative_decoding is None:
    return None, "no speculative_decoding block"
  return generation.speculative_decoding, ""


def _package_verdict(canonical: str, scope: str, model_id: str, source_path: str | None,
                     manifest: Manifest) -> _Verdict:
  sd, missing = _speculative_block(manifest)
  if canonical == AUTO:
    if sd is None:
      return _Verdict(False, f"auto (from {scope}): the package advertises {missing}, so native "
                      "MTP stays off")
    return _auto_verdict(scope, model_id, source_path, sd)
  if canonical != NATIVE_MTP_N1:
    return _declared_verdict(canonical, scope, model_id, source_path, sd)
  candidate, summary = (None, missing) if sd is None else _package_named(sd)
  if candidate is not None:
    name = NATIVE_MTP_N1 if NATIVE_MTP_N1 in sd.strategies else "mtp"
    return _native_verdict(f"{canonical} (from {scope}): the package advertises {summary}", sd,
                           name, candidate)
  raise SpeculativeConfigError(
      f'model {model_id}: speculative.strategy = "native-mtp-n1" requires package generation '
      f"metadata advertising native-mtp-n1; the package advertises {summary} (from {scope}). "
      f"Remedy: set the strategy to auto or disabled, or {_RESPLIT}.",
      path=source_path, field=scope)


def _gguf_verdict(canonical: str, scope: str, model_id: str, source_path: str | None,
                  gguf_metadata: Mapping[str, Any], nextn: dict[int, set[str]]) -> _Verdict:
  """GGUF_PROOF needs metadata AND tensors: either alone has shipped without a usable head."""
  if canonical not in (AUTO, NATIVE_MTP_N1):
    raise SpeculativeConfigError(
        f'model {source_path or model_id}: speculative.strategy = "{canonical}" names a package '
        f"strategy, but a direct GGUF declares none (from {scope})", path=source_path,
        field=scope, remedy="use auto, disabled, native-mtp-n1 or an ngram-* value, or serve a "
                            "layer package")
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


def _drafting_type(native_mtp: bool, ngram: NgramSettings | None) -> str | None:
  if native_mtp:
    return NATIVE_MTP_TYPE if ngram is None else COMPOSITE_TYPE
  return None if ngram is None else ngram.type


def resolve_speculative(*, model_id: str, requested: str | None, scope: str, source_kind: str,
                        manifest: Manifest | None, layer_count: int,
                        gguf_metadata: Mapping[str, Any], tensor_names: Iterable[str],
                        env: Mapping[str, str] | None = None,
                        source_path: str | None = None, max_draft_tokens: int | None = None,
                        max_draft_tokens_field: str = "speculative.max_draft_tokens"
                        ) -> SpeculativeResolution:
  """Applies the docs/SPECULATIVE.md §4 matrix, the on-consistency check and the §5 kill switch,
  and the draft window (`draft_window.resolve_window`; `max_draft_tokens` from the config
  field `max_draft_tokens_field`).

  `requested` None means nothing was set (built-in auto). `source_path` only enriches errors.
  The kill switch turns native MTP off; n-gram drafting does not use the head and stays (a
  composite keeps its extender, drafting alone).
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
  elif canonical in NGRAM_STRATEGIES:
    verdict = _ngram_verdict(canonical, scope,
                             _speculative_block(manifest)[0] if source_kind == PACKAGE else None)
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
  reason = verdict.reason
  if not allows:
    extender_left = verdict.on and verdict.ngram is not None
    reason += f"; {ENV_VAR} turns native MTP off" + (
        ", so its n-gram extender drafts alone" if extender_left else "")
  drafting = _drafting_type(effective, verdict.ngram)
  return SpeculativeResolution(
      model_id=model_id, requested=canonical, scope=scope, native_mtp=effective,
      mtp_layer_index=layer_index if effective else None,
      window_policy=_policy_dict(verdict.policy) if drafting else None,
      disabled_by_env=not allows, reason=reason, strategy_type=drafting,
      strategy_id=verdict.strategy_id if drafting else None, ngram=verdict.ngram,
      extension=verdict.extension if effective else None,
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
                       env: Mapping[str, str] | None = None,
                       override: tuple[str, str] | None = None) -> SpeculativeResolution:
  """Resolution for an opened source (kind, manifest, metadata, tensors, layer_count, path);
  `override` (value, scope) replaces the config's strategy (a `generate(speculative=...)`),
  the rest of the config (the draft window) still applies."""
  if override is None:
    requested, scope = strategy_from_config(config, model_name)
  else:
    requested, scope = normalize_strategy(override[0], override[1]), override[1]
  max_draft_tokens, field = max_draft_tokens_from_config(config, model_name)
  manifest = source.manifest
  path = None if source.path is None else str(source.path)
  model_id = manifest.model_id if manifest is not None else (path or model_name)
  return resolve_speculative(
      model_id=model_id, requested=requested, scope=scope, source_kind=source.kind,
      manifest=manifest, layer_count=source.layer_count, gguf_metadata=source.metadata,
      tensor_names=source.tensors.keys(), env=env, source_path=path,
      max_draft_tokens=max_draft_tokens, max_draft_tokens_field=field)
