"""Chat templates under a budget: hostile templates stop with a clear error, others render as before.

Hostile sizes depend on `messages` so that no compile-time constant folding (the stock
renderer folds constant expressions when it compiles) evaluates them outside a render.

References: the stock sandboxed `ChatTemplate` (the renderer without a budget) for the benign
templates, and the clock for the hostile ones (each must stop near its 0.3 s budget instead of
running for minutes or allocating gigabytes).
"""

from __future__ import annotations

import time

from absl.testing import absltest, parameterized

from mtpjax import embedded, errors
from mtpjax.gguf.tokenizer import ChatTemplate
from mtpjax.package.reader import open_source
from mtpjax.gguf.template_budget import (BudgetedChatTemplate, TemplateBudget,
                                           TemplateBudgetExceeded)

_BUDGET = TemplateBudget(seconds=0.3, max_chars=100_000)
_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]


def _demo_metadata() -> dict:
  with open_source(embedded.DEMO_PACKAGE) as source:
    return dict(source.metadata)


class TemplateBudgetTest(parameterized.TestCase):

  # Work without output runs into the clock; anything that grows a string, a sequence or a
  # number is refused by its size before it is built (a late refusal would allocate the
  # gigabytes first and then answer the clock).
  @parameterized.named_parameters(
      ("nested_loops", "template_timeout_s",
       "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
      ("nested_loops_with_loop_var", "template_timeout_s",
       "{% for i in range(100000) %}{% for j in range(100000) %}"
       "{{ loop.index if loop.last }}{% endfor %}{% endfor %}"),
      ("recursive_macro", "template_timeout_s",
       "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
       "{% endmacro %}{{ f(40) }}"),
      ("output", "template_max_chars",
       "{% for i in range(100000) %}{{ 'abcdefghij' }}{% endfor %}"),
      ("literal_output", "template_max_chars",
       "{% for i in range(100000) %}0123456789{% endfor %}"),
      ("repeat", "template_max_chars", "{{ 'a' * (messages|length * 250000000) }}"),
      ("list_repeat", "template_max_chars",
       "{{ ([1] * (messages|length * 250000000))|length }}"),
      ("power", "template_max_chars", "{{ 10 ** (messages|length * 250000000) }}"),
      ("doubling_concat", "template_max_chars",
       "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"),
      ("doubling_plus", "template_max_chars",
       "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
       "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}"),
      ("center_method", "template_max_chars", "{{ 'x'.center(messages|length * 250000000) }}"),
      ("center_filter", "template_max_chars", "{{ 'x'|center(messages|length * 250000000) }}"),
      ("indent_filter", "template_max_chars",
       "{{ 'x\\ny'|indent(messages|length * 250000000) }}"),
      ("percent_format", "template_max_chars",
       "{{ ('%' ~ (messages|length * 250000000) ~ 'd') % 1 }}"),
      ("percent_star", "template_max_chars", "{{ '%*d' % ((messages|length * 250000000), 1) }}"),
      ("format_filter", "template_max_chars",
       "{{ ('%' ~ (messages|length * 250000000) ~ 's')|format('x') }}"),
      ("str_format", "template_max_chars",
       "{{ ('{:>' ~ (messages|length * 250000000) ~ '}').format('x') }}"),
      ("str_format_nested", "template_max_chars",
       "{{ '{:>{w}}'.format('x', w=(messages|length * 250000000)) }}"),
      ("str_format_map", "template_max_chars",
       "{{ '{w:>{w}}'.format_map({'w': messages|length * 250000000}) }}"),
  )
  def test_hostile_template_stops_within_its_budget(self, limit, source):
    template = BudgetedChatTemplate(source, budget=_BUDGET)
    started = time.perf_counter()
    with self.assertRaises(errors.ConversionError) as raised:
      template.render(_MESSAGES, add_generation_prompt=True)
    self.assertLess(time.perf_counter() - started, 5.0)
    self.assertIsInstance(raised.exception.__cause__, TemplateBudgetExceeded)
    self.assertIn(f"server.{limit}", raised.exception.message)

  @parameterized.named_parameters(
      ("default_glm", None),
      ("demo_package", "demo"),
      ("features", "{% for m in messages %}{{ loop.index }}:{{ m.role|upper }}"
       "{{ ' ' ~ m.content|indent(2) }}{{ '%-6s|' % m.role }}{{ '{:>4}'.format(loop.length) }}"
       "{{ m.content|center(12) }}{% if loop.last %}{{ ([1] + [2]) * 2 }}{% endif %}"
       "{% endfor %}{{ 2 ** 10 }}{{ 7 % 3 }}{{ 'x' * 3 }}{{ messages|tojson }}"
       "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
  )
  def test_benign_template_renders_as_the_stock_renderer(self, source):
    if source == "demo":
      stock = ChatTemplate.from_metadata(_demo_metadata())
      budgeted = BudgetedChatTemplate.from_metadata(_demo_metadata(), budget=_BUDGET)
    else:
      stock, budgeted = ChatTemplate(source), BudgetedChatTemplate(source, budget=_BUDGET)
    for messages in (_MESSAGES, _MESSAGES[1:2], []):
      for prompt in (True, False):
        self.assertEqual(budgeted.render(messages, add_generation_prompt=prompt),
                         stock.render(messages, add_generation_prompt=prompt))

  def test_a_constant_expression_does_not_hang_the_compile(self):
    """jinja's code generator folds constant output expressions while compiling; the stock
    template would evaluate this one at start-up, before any render budget."""
    started = time.perf_counter()
    template = BudgetedChatTemplate("{{ 10 ** 1000000000 }}", budget=_BUDGET)
    self.assertLess(time.perf_counter() - started, 5.0)
    with self.assertRaises(errors.ConversionError) as raised:
      template.render(_MESSAGES)
    self.assertIsInstance(raised.exception.__cause__, TemplateBudgetExceeded)

  def test_template_errors_keep_their_meaning(self):
    template = BudgetedChatTemplate("{{ raise_exception('no system role') }}", budget=_BUDGET)
    with self.assertRaisesRegex(errors.ConversionError, "no system role"):
      template.render(_MESSAGES)
    unsafe = BudgetedChatTemplate("{{ messages.__class__ }}", budget=_BUDGET)
    with self.assertRaisesRegex(errors.ConversionError, "unsafe"):
      unsafe.render(_MESSAGES)


if __name__ == "__main__":
  absltest.main()
