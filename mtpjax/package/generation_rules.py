"""Rules of `generation.speculative_decoding` (LAYER_PACKAGES.md §5), as preflight issues.

Kept apart from manifest.py because these rules change with upstream's speculative schema while
the artifact rules do not.
"""

from __future__ import annotations

from mtpjax.package.issues import WARNING, is_blank, is_int, issue

NATIVE_MTP_TYPE = "native-mtp"
_WINDOW_FIELDS = ("initial_window", "min_window", "max_window")


def _window_policy_issues(name: str, policy: object) -> list[dict]:
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


def _strategy_issues(name: str, strategy: object, proposers: dict,
                     layer_count: int | None) -> list[dict]:
  if not isinstance(strategy, dict):
    return [issue("empty_speculative_strategy_type",
                  f"speculative strategy {name} must be an object with a type")]
  found = []
  body = strategy
  proposer = strategy.get("proposer")
  if proposer is not None:
    body = proposers.get(proposer) if isinstance(proposer, str) else None
    if not isinstance(body, dict):
      return [issue("missing_speculative_proposer",
                    f"speculative strategy {name} names proposer {proposer!r}, which "
                    "speculative_decoding.proposers does not define")]
  kind = body.get("type")
  if is_blank(kind):
    found.append(issue("empty_speculative_strategy_type",
                       f"speculative strategy {name} type must not be empty"))
  elif kind != NATIVE_MTP_TYPE:
    found.append(issue("unsupported_speculative_strategy_type",
                       f"speculative strategy {name} has type {kind}, which mtpjax does not run; "
                       "it cannot enable native MTP", severity=WARNING))
  else:
    if body.get("prediction_depth") != 1 or isinstance(body.get("prediction_depth"), bool):
      found.append(issue("unsupported_native_mtp_prediction_depth",
                         f"native MTP strategy {name} must use prediction_depth 1"))
    layers = body.get("layer_indices")
    if not isinstance(layers, list) or not layers:
      found.append(issue("missing_native_mtp_layers",
                         f"native MTP strategy {name} must declare MTP layer_indices"))
    else:
      for index in layers:
        if not is_int(index) or index < 0 or (layer_count is not None and index >= layer_count):
          found.append(issue("native_mtp_layer_out_of_range",
                             f"native MTP strategy {name} references layer {index}, but "
                             f"layer_count is {layer_count}"))
  return found + _window_policy_issues(name, strategy.get("window_policy"))


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
  for name, strategy in strategies.items():
    if not name.strip():
      found.append(issue("empty_speculative_strategy_name",
                         "speculative strategy names must not be empty"))
    found.extend(_strategy_issues(name, strategy, proposers, layer_count))
  return found
