"""Rules of `generation.speculative_decoding` (docs/LAYER_PACKAGES.md §5), as preflight issues.

Every era of the v1 block is read: inline `native-mtp-n1` / `mtp` strategies, a `proposers` map
that strategies refer to, n-gram strategies and `composite` strategies (a native-MTP primary
extended by an n-gram proposer). Codes follow upstream's preflight. A strategy or proposer type
mtpjax does not know is ignored with a warning (its other fields are not read), so a package
from a newer writer stays loadable; whether its default can be served is resolution's call.

Kept apart from manifest.py because these rules change with upstream's speculative schema while
the artifact rules do not.
"""

from __future__ import annotations

from mtpjax.package.issues import WARNING, is_blank, is_int, issue

NATIVE_MTP_TYPE = "native-mtp"
NGRAM_SIMPLE_TYPE = "ngram-simple"
NGRAM_CACHE_TYPE = "ngram-cache"
NGRAM_SUFFIX_TYPE = "ngram-suffix"
NGRAM_TYPES = (NGRAM_SIMPLE_TYPE, NGRAM_CACHE_TYPE, NGRAM_SUFFIX_TYPE)
COMPOSITE_TYPE = "composite"
PROPOSER_TYPES = (NATIVE_MTP_TYPE, *NGRAM_TYPES)
STRATEGY_TYPES = (*PROPOSER_TYPES, COMPOSITE_TYPE)
REQUEST_HISTORY = "request"          # the only n-gram history_scope: never shared across requests
NGRAM_CACHE_MAX_NGRAM = 4            # llama.cpp's n-gram cache matches at most 4 tokens
NGRAM_SUFFIX_MIN_NGRAM, NGRAM_SUFFIX_MAX_NGRAM = 3, 64
MAX_PIPELINE_DEPTH = 64              # upstream's bound on verify windows in flight
_WINDOW_FIELDS = ("initial_window", "min_window", "max_window")


def window_policy_issues(name: str, policy: object) -> list[dict]:
  """The preflight issues of one strategy's window_policy (none when it is absent)."""
  if policy is None:
    return []
  where = f"speculative strategy {name} window_policy"
  if not isinstance(policy, dict):
    return [issue("empty_window_policy_default", f"{where} must be an object")]
  found = []
  if is_blank(policy.get("default")):
    found.append(issue("empty_window_policy_default", f"{where}.default must not be empty"))
  windows = {field: policy.get(field) for field in _WINDOW_FIELDS}
  bad = [field for field, value in windows.items() if not is_int(value) or value <= 0]
  if bad:
    found.append(issue("invalid_window_policy_zero",
                       f"{where}: {', '.join(bad)} must be integers greater than zero"))
    return found
  if windows["min_window"] > windows["max_window"]:
    found.append(issue("invalid_window_policy_bounds",
                       f"{where}: min_window {windows['min_window']} > max_window "
                       f"{windows['max_window']}"))
  elif not windows["min_window"] <= windows["initial_window"] <= windows["max_window"]:
    found.append(issue("invalid_window_policy_initial",
                       f"{where}: initial_window {windows['initial_window']} is outside "
                       f"[{windows['min_window']}, {windows['max_window']}]"))
  return found


def _pipeline_depth_issues(name: str, policy: object) -> list[dict]:
  """`window_policy.pipeline_depth` (newer packages): verify windows in flight, 1..64."""
  depth = policy.get("pipeline_depth") if isinstance(policy, dict) else None
  if depth is None or (is_int(depth) and 1 <= depth <= MAX_PIPELINE_DEPTH):
    return []
  return [issue("invalid_window_policy_pipeline_depth",
                f"speculative strategy {name} window_policy.pipeline_depth must be an integer "
                f"from 1 to {MAX_PIPELINE_DEPTH}, got {depth!r}")]


def _native_mtp_issues(what: str, depth: object, layers: object,
                       layer_count: int | None) -> list[dict]:
  """Depth 1 and NextN layers inside the package, for an inline strategy or a proposer."""
  found = []
  if depth != 1 or isinstance(depth, bool):
    found.append(issue("unsupported_native_mtp_prediction_depth",
                       f"native MTP {what} must use prediction_depth 1"))
  if not isinstance(layers, list) or not layers:
    found.append(issue("missing_native_mtp_layers",
                       f"native MTP {what} must declare MTP layer_indices"))
    return found
  for index in layers:
    if not is_int(index) or index < 0 or (layer_count is not None and index >= layer_count):
      found.append(issue("native_mtp_layer_out_of_range",
                         f"native MTP {what} references layer {index}, but layer_count is "
                         f"{layer_count}"))
  return found


def _ngram_issues(name: str, kind: str, proposer: dict) -> list[dict]:
  found = []
  low, high = proposer.get("ngram_min"), proposer.get("ngram_max")
  window_ok = is_int(low) and is_int(high) and 1 <= low <= high
  if not window_ok:
    found.append(issue("invalid_ngram_proposer_window",
                       f"n-gram proposer {name} needs integers 1 <= ngram_min <= ngram_max, got "
                       f"ngram_min {low!r} and ngram_max {high!r}"))
  tokens = proposer.get("max_proposal_tokens")
  if not is_int(tokens) or tokens < 1:
    found.append(issue("invalid_ngram_proposer_max_tokens",
                       f"n-gram proposer {name} max_proposal_tokens must be an integer greater "
                       f"than zero, got {tokens!r}"))
  if kind == NGRAM_SIMPLE_TYPE:
    return found
  label = kind.removeprefix("ngram-")                  # "cache" or "suffix", as in the codes
  if window_ok and kind == NGRAM_CACHE_TYPE and high > NGRAM_CACHE_MAX_NGRAM:
    found.append(issue("unsupported_ngram_cache_max_window",
                       f"n-gram cache proposer {name} has ngram_max {high}, above the "
                       f"{NGRAM_CACHE_MAX_NGRAM}-token match window an n-gram cache supports"))
  if (window_ok and kind == NGRAM_SUFFIX_TYPE
      and not NGRAM_SUFFIX_MIN_NGRAM <= low <= high <= NGRAM_SUFFIX_MAX_NGRAM):
    found.append(issue("unsupported_ngram_suffix_window",
                       f"n-gram suffix proposer {name} needs {NGRAM_SUFFIX_MIN_NGRAM} <= "
                       f"ngram_min <= ngram_max <= {NGRAM_SUFFIX_MAX_NGRAM}, got {low}..{high}"))
  scope = proposer.get("history_scope")
  if scope != REQUEST_HISTORY:
    found.append(issue(f"invalid_ngram_{label}_history_scope",
                       f"n-gram {label} proposer {name} must set history_scope to "
                       f"{REQUEST_HISTORY!r}, got {scope!r}"))
  return found


def _proposer_issues(name: str, proposer: object, layer_count: int | None) -> list[dict]:
  found = []
  if not name.strip():
    found.append(issue("empty_speculative_proposer_name",
                       "speculative proposer names must not be empty"))
  kind = proposer.get("type") if isinstance(proposer, dict) else None
  if is_blank(kind):
    found.append(issue("unsupported_speculative_proposer_type",
                       f"speculative proposer {name} must be an object with a non-empty type"))
  elif kind == NATIVE_MTP_TYPE:
    found.extend(_native_mtp_issues(f"proposer {name}", proposer.get("prediction_depth"),
                                    proposer.get("layer_indices"), layer_count))
  elif kind in NGRAM_TYPES:
    found.extend(_ngram_issues(name, kind, proposer))
  else:
    found.append(issue("unsupported_speculative_proposer_type",
                       f"speculative proposer {name} has type {kind}, which mtpjax does not run; "
                       "it is ignored", severity=WARNING))
  return found


def _declared_proposer(reference: object, proposers: dict) -> dict | None:
  """The proposer body a strategy field names, or None when it names none."""
  body = proposers.get(reference) if isinstance(reference, str) else None
  return body if isinstance(body, dict) else None


def _reference_issues(name: str, field: str, reference: object, proposers: dict) -> list[dict]:
  if _declared_proposer(reference, proposers) is not None:
    return []
  return [issue("missing_speculative_proposer",
                f"speculative strategy {name} {field} names proposer {reference!r}, which "
                "speculative_decoding.proposers does not define")]


def _native_mtp_strategy_issues(name: str, strategy: dict, proposers: dict,
                                layer_count: int | None) -> list[dict]:
  """Inline depth/layers, or a `proposer` that must be native MTP (it is checked itself)."""
  reference = strategy.get("proposer")
  if reference is None:
    return _native_mtp_issues(f"strategy {name}", strategy.get("prediction_depth"),
                              strategy.get("layer_indices"), layer_count)
  body = _declared_proposer(reference, proposers)
  if body is not None and body.get("type") != NATIVE_MTP_TYPE:
    return [issue("native_mtp_strategy_proposer_type_mismatch",
                  f"native MTP strategy {name} names proposer {reference}, whose type is "
                  f"{body.get('type')}")]
  return []


def _ngram_strategy_issues(name: str, kind: str, strategy: dict, proposers: dict) -> list[dict]:
  reference = strategy.get("proposer")
  if reference is None:
    return [issue("missing_ngram_strategy_proposer",
                  f"n-gram strategy {name} must name its proposer")]
  body = _declared_proposer(reference, proposers)
  if body is not None and body.get("type") != kind:
    return [issue("ngram_strategy_proposer_type_mismatch",
                  f"n-gram strategy {name} has type {kind}, but its proposer {reference} has "
                  f"type {body.get('type')}")]
  return []


def _composite_issues(name: str, strategy: dict, proposers: dict) -> list[dict]:
  """A native-MTP `primary` whose draft an n-gram `extender` continues, per `extension_policy`."""
  found = []
  if strategy.get("extension_policy") is None:
    found.append(issue("missing_composite_extension_policy",
                       f"composite strategy {name} must declare extension_policy"))
  roles = (("primary", (NATIVE_MTP_TYPE,), "native-mtp"),
           ("extender", NGRAM_TYPES, "an n-gram proposer"))
  for field, allowed, wanted in roles:
    reference = strategy.get(field)
    if reference is None:
      found.append(issue(f"missing_composite_{field}",
                         f"composite strategy {name} must declare {field}"))
      continue
    found.extend(_reference_issues(name, field, reference, proposers))
    body = _declared_proposer(reference, proposers)
    if body is not None and body.get("type") not in allowed:
      found.append(issue(f"invalid_composite_{field}_type",
                         f"composite strategy {name} {field} {reference} has type "
                         f"{body.get('type')}; it must be {wanted}"))
  return found


def _extension_policy_issues(name: str, policy: object) -> list[dict]:
  """`max_tokens` >= 1; optional `initial_tokens` in [1, max_tokens], `tail_backoff_proposals`
  >= 0 (older writers always wrote both, newer ones only `max_tokens`)."""
  where = f"speculative strategy {name} extension_policy"
  if not isinstance(policy, dict):
    return [issue("invalid_extension_policy_tokens", f"{where} must be an object")]
  most = policy.get("max_tokens")
  if not is_int(most) or most < 1:
    return [issue("invalid_extension_policy_tokens",
                  f"{where}.max_tokens must be an integer greater than zero, got {most!r}")]
  found = []
  first = policy.get("initial_tokens")
  if first is not None and (not is_int(first) or not 1 <= first <= most):
    found.append(issue("invalid_extension_policy_tokens",
                       f"{where} must satisfy 1 <= initial_tokens <= max_tokens, got "
                       f"initial_tokens {first!r} and max_tokens {most}"))
  backoff = policy.get("tail_backoff_proposals")
  if backoff is not None and (not is_int(backoff) or backoff < 0):
    found.append(issue("invalid_extension_policy_tokens",
                       f"{where}.tail_backoff_proposals must be a non-negative integer, got "
                       f"{backoff!r}"))
  return found


def _unknown_strategy_issue(name: str, kind: str, is_default: bool) -> dict:
  if not is_default:
    return issue("unsupported_speculative_strategy_type",
                 f"speculative strategy {name} has type {kind}, which mtpjax does not run; it is "
                 "ignored", severity=WARNING)
  return issue("unsupported_speculative_strategy_type",
               f"speculative strategy {name} is the package default but has type {kind}, which "
               "mtpjax does not run; `auto` cannot serve it", severity=WARNING,
               remediation="serve this package with speculative.strategy set to disabled or to "
                           "one of its strategies whose type mtpjax runs")


def _strategy_issues(name: str, strategy: object, proposers: dict, layer_count: int | None,
                     is_default: bool) -> list[dict]:
  if not isinstance(strategy, dict):
    return [issue("empty_speculative_strategy_type",
                  f"speculative strategy {name} must be an object with a type")]
  kind = strategy.get("type")
  if is_blank(kind):
    return [issue("empty_speculative_strategy_type",
                  f"speculative strategy {name} type must not be empty")]
  if kind not in STRATEGY_TYPES:
    return [_unknown_strategy_issue(name, kind, is_default)]
  found = []
  if strategy.get("proposer") is not None:
    found.extend(_reference_issues(name, "proposer", strategy["proposer"], proposers))
  if kind == NATIVE_MTP_TYPE:
    found.extend(_native_mtp_strategy_issues(name, strategy, proposers, layer_count))
  elif kind == COMPOSITE_TYPE:
    found.extend(_composite_issues(name, strategy, proposers))
  else:
    found.extend(_ngram_strategy_issues(name, kind, strategy, proposers))
  if strategy.get("extension_policy") is not None:
    found.extend(_extension_policy_issues(name, strategy["extension_policy"]))
  policy = strategy.get("window_policy")
  return found + window_policy_issues(name, policy) + _pipeline_depth_issues(name, policy)


def generation_issues(generation: object, layer_count: int | None) -> list[dict]:
  if generation is None:
    return []
  if not isinstance(generation, dict):
    return [issue("invalid_generation", "package manifest generation must be an object")]
  speculative = generation.get("speculative_decoding")
  if speculative is None:
    return []
  if not isinstance(speculative, dict):
    return [issue("invalid_generation", "generation.speculative_decoding must be an object")]
  found = []
  strategies = speculative.get("strategies")
  strategies = {} if strategies is None else strategies
  proposers = speculative.get("proposers")
  proposers = {} if proposers is None else proposers
  if not isinstance(strategies, dict) or not isinstance(proposers, dict):
    found.append(issue("invalid_generation", "speculative_decoding.strategies and .proposers must "
                       "be objects mapping ids to definitions"))
    strategies = strategies if isinstance(strategies, dict) else {}
    proposers = proposers if isinstance(proposers, dict) else {}
  default = speculative.get("default")
  if is_blank(default):
    found.append(issue("empty_speculative_default",
                       "speculative_decoding.default must not be empty"))
  elif default not in strategies:
    found.append(issue("missing_speculative_default_strategy",
                       f"speculative_decoding.default {default!r} is not one of the strategies "
                       f"{sorted(strategies)}"))
  for name, proposer in proposers.items():
    found.extend(_proposer_issues(name, proposer, layer_count))
  for name, strategy in strategies.items():
    if not name.strip():
      found.append(issue("empty_speculative_strategy_name",
                         "speculative strategy names must not be empty"))
    found.extend(_strategy_issues(name, strategy, proposers, layer_count, name == default))
  return found
