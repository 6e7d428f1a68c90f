"""Chat templates rendered under a time and an output-size budget.

A package's chat template is untrusted code, for the server and the text API alike: the sandbox (`mtpjax.gguf.tokenizer`) stops
escapes but not work, and a render running in a thread cannot be killed. So the budget is
enforced inside the render: every loop iteration, call, `~` concatenation, sequence `+`/`*`,
`**`, padding format (`%`, `str.format`, `center`, `indent`, `format`) and output chunk
checks the clock and the sizes, and raises `TemplateBudgetExceeded`
(a jinja2 `TemplateError`, so the request gets a clear 400). Loops and concatenations are
metered by rewriting the template's syntax tree before it compiles.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import re
import time
from typing import Any, Iterable, Iterator

import jinja2
from jinja2 import nodes
from jinja2.visitor import NodeTransformer

# The package's own sandbox (refuses unsafe attributes loudly), extended here with budgets.
from mtpjax.gguf.tokenizer import ChatSandbox, ChatTemplate

_LOOP = "__mtpjax_metered_loop"
_CONCAT = "__mtpjax_metered_concat"
# str methods whose integer argument is a result width (`"x".center(10**9)`).
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
# The conversion specs of a %-format and the replacement fields of a str.format string: the
# numbers in them are widths and precisions, which can make a tiny format build a huge string.
_FORMAT_SPECS = re.compile(r"%[-#0 +]*[\d*]*(?:\.[\d*]*)?|\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")


class TemplateBudgetExceeded(jinja2.TemplateError):
  """The render ran past its time or output-size budget."""


@dataclasses.dataclass(frozen=True)
class TemplateBudget:
  """A render's limits; the defaults are the server's (`server.template_timeout_s`,
  `server.template_max_chars`) and what `model.tokenizer` renders under."""
  seconds: float = 1.0
  max_chars: int = 4 * 2**20


class _Meter:
  """One render's clock and output count."""

  def __init__(self, budget: TemplateBudget):
    self.budget = budget
    self.deadline = time.perf_counter() + budget.seconds
    self.chars = 0

  def tick(self) -> None:
    if time.perf_counter() > self.deadline:
      raise TemplateBudgetExceeded(
          f"the chat template ran past its time budget of {self.budget.seconds:g} s "
          "(server.template_timeout_s)")

  def check_size(self, chars: int, what: str) -> None:
    if chars > self.budget.max_chars:
      raise TemplateBudgetExceeded(
          f"the chat template would build {what} of {chars} characters, over its budget of "
          f"{self.budget.max_chars} (server.template_max_chars)")

  def emit(self, chunk: str) -> None:
    self.tick()
    self.chars += len(chunk)
    self.check_size(self.chars, "an output")


_METER: contextvars.ContextVar[_Meter | None] = contextvars.ContextVar("template_meter",
                                                                      default=None)


def _tick() -> _Meter | None:
  meter = _METER.get()
  if meter is not None:
    meter.tick()
  return meter


def _metered_loop(iterable: Iterable[Any]) -> Iterator[Any]:
  """What every `{% for %}` iterates: the items of `iterable`, one clock check each."""
  for item in iterable:
    _tick()
    yield item


def _metered_concat(*parts: Any) -> str:
  """`a ~ b ~ ...` with its result size checked before it is built."""
  texts = [str(p) for p in parts]
  meter = _tick()
  if meter is not None:
    meter.check_size(sum(map(len, texts)), "a string")
  return "".join(texts)


def _check_format(meter: _Meter, fmt: str, args: Any) -> None:
  """Refuses a format whose widths, or the width arguments it takes (`*`, `{:{w}}`), exceed
  the output budget."""
  values = args if isinstance(args, (tuple, list)) else (
      list(args.values()) if isinstance(args, dict) else [args])
  for spec in _FORMAT_SPECS.findall(fmt):
    widths = [int(n) for n in re.findall(r"\d+", spec)]
    if "*" in spec or spec.count("{") > 1:
      widths += [v for v in values if isinstance(v, int)]
    meter.check_size(max(widths, default=0), "a formatted string")


def _budgeted_filter(fn, check):
  """`fn` (a jinja filter) after `check(meter, *args, **kwargs)`; keeps jinja's pass_* marks."""
  @functools.wraps(fn)
  def filtered(*args, **kwargs):
    meter = _tick()
    if meter is not None:
      check(meter, *args, **kwargs)
    return fn(*args, **kwargs)
  return filtered


def _check_center(meter: _Meter, value: Any, width: int = 80) -> None:
  meter.check_size(width if isinstance(width, int) else 0, "a string")


def _check_indent(meter: _Meter, value: Any, width: int | str = 4, *_, **__) -> None:
  pad = width if isinstance(width, int) else len(str(width))
  lines = str(value).count("\n") + 1
  meter.check_size(len(str(value)) + pad * lines, "an indented string")


def _check_format_filter(meter: _Meter, value: Any, *args: Any, **kwargs: Any) -> None:
  _check_format(meter, str(value), kwargs or args)


_FILTER_CHECKS = {"center": _check_center, "indent": _check_indent,
                  "format": _check_format_filter}


def _sized(value: Any) -> int | None:
  return len(value) if isinstance(value, (str, list, tuple)) else None


class _MeterRewriter(NodeTransformer):
  """Wraps every loop's iterable in `_metered_loop` and turns `~` into `_metered_concat`."""

  def __init__(self, environment: jinja2.Environment):
    self._environment = environment

  def _call(self, name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    call = nodes.Call(nodes.Name(name, "load", lineno=lineno), args, [], None, None,
                      lineno=lineno)
    return call.set_environment(self._environment)

  def visit_For(self, node: nodes.For) -> nodes.For:
    node = self.generic_visit(node)
    node.iter = self._call(_LOOP, [node.iter], node.lineno)
    return node

  def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
    node = self.generic_visit(node)
    return self._call(_CONCAT, list(node.nodes), node.lineno)


class _BudgetSandbox(ChatSandbox):
  """The chat sandbox, with calls and size-growing operators metered."""

  intercepted_binops = frozenset({"+", "*", "**", "%"})

  def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
    meter = _tick()
    # jinja >= 3.1.5 hands templates `str.format` wrapped (its sandboxed formatter), without
    # `__self__`; the bound method it wraps says which string formats.
    method = getattr(__obj, "__wrapped__", __obj)
    name = getattr(method, "__name__", None)
    if meter is not None and isinstance(getattr(method, "__self__", None), str):
      if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        meter.check_size(args[0], "a string")
      elif name in ("format", "format_map"):
        _check_format(meter, method.__self__, kwargs or (args[0] if name == "format_map"
                                                        and args else args))
    return super().call(__context, __obj, *args, **kwargs)

  def call_binop(self, context, operator, left, right):
    meter = _tick()
    if meter is not None:
      if operator == "+" and _sized(left) is not None and _sized(right) is not None:
        meter.check_size(_sized(left) + _sized(right), "a sequence")
      elif operator == "*":
        for seq, times in ((left, right), (right, left)):
          if _sized(seq) is not None and isinstance(times, int):
            meter.check_size(_sized(seq) * times, "a sequence")
      elif operator == "%" and isinstance(left, str):
        _check_format(meter, left, right)
      elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        meter.check_size(abs(left).bit_length() * right // 3, "a number")   # ~decimal digits
    return super().call_binop(context, operator, left, right)


class _MeteredTemplate:
  """Stands in for the compiled jinja2 template: renders chunk by chunk under a fresh meter."""

  def __init__(self, template: jinja2.Template, budget: TemplateBudget):
    self._template = template
    self._budget = budget

  def render(self, **variables: Any) -> str:
    meter = _Meter(self._budget)
    token = _METER.set(meter)
    try:
      parts = []
      for chunk in self._template.generate(**variables):
        meter.emit(chunk)
        parts.append(chunk)
      return "".join(parts)
    finally:
      _METER.reset(token)


class BudgetedChatTemplate(ChatTemplate):
  """A `ChatTemplate` compiled metered and rendered under `budget`; errors map as the parent's.

  The stock compile never runs: jinja's code generator evaluates constant output expressions
  while compiling, so `{{ 10 ** 1000000000 }}` in a package would hang start-up before any
  render budget applied. Here the tree is metered before it compiles.
  """

  def __init__(self, source: str | None = None, *, budget: TemplateBudget, **kwargs: Any):
    self.budget = budget
    super().__init__(source, **kwargs)

  def _compile(self, source: str) -> _MeteredTemplate:
    env = self.environment(_BudgetSandbox, optimized=False)   # nothing evaluated at compile time
    env.globals.update({_LOOP: _metered_loop, _CONCAT: _metered_concat})
    env.filters.update({name: _budgeted_filter(env.filters[name], check)
                        for name, check in _FILTER_CHECKS.items()})
    tree = _MeterRewriter(env).visit(env.parse(source))
    return _MeteredTemplate(env.from_string(tree), self.budget)
