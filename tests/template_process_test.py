"""Chat templates rendered in killable children (mtpjax/gguf/template_process.py): a single
filter call that the in-render budget cannot interrupt still ends at the deadline.

The escapes are the five filters issue 52 found (`map`, `sum`, `groupby`, `sort`, `replace`);
rendered in this process under the same 0.5 s budget, `sum`, `groupby` and `sort` ran 18-120 s
here (sizes below are smaller, but each still runs for seconds in-process), and `replace`
builds a value of gigabytes. References: the clock, and the in-process renderer's output for
a benign template.
"""

from __future__ import annotations

import concurrent.futures
import time

from absl.testing import absltest, parameterized

from mtpjax import errors
from mtpjax.gguf.template_budget import (BudgetedChatTemplate, TemplateBudget,
                                         TemplateBudgetExceeded)
from mtpjax.gguf.template_process import TemplateProcesses, grace_seconds

_BUDGET = TemplateBudget(seconds=0.5, max_chars=4 * 2**20)
_MESSAGES = [{"role": "user", "content": "abcd"}]
_BENIGN = ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content|trim }}{% endfor %}"
           "{% if tools %}{{ tools|tojson }}{% endif %}{{ extra }}"
           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Every stop must come within the budget, the grace period and the machine's slack.
_DEADLINE_S = _BUDGET.seconds + grace_seconds(_BUDGET) + 3.0
# Where a test checks what a render gives, not when it stops: room for a loaded host.
_ROOMY_BUDGET = TemplateBudget(seconds=30.0, max_chars=4 * 2**20)


class TemplateProcessTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("map", "{% set xs = [messages[0].content * 4000] * 100000 %}"
              "{{ xs|map('upper')|map('lower')|list|length }}"),
      ("sum", "{% set xs = [[1] * 1000] * 3000 %}{{ (xs|sum(start=[]))|length }}"),
      ("groupby", "{% set xs = [{'a': messages[0].content * 2000}] * 1000000 %}"
                  "{{ xs|groupby('a')|list|length }}"),
      ("sort", "{% set xs = [messages[0].content] * 3000000 %}"
               "{{ (xs|map('reverse')|sort)|length }}"),
      ("replace", "{{ (messages[0].content * 1000000)|replace('a', messages[0].content * 1000)"
                  "|length }}"),
  )
  def test_a_filter_call_cannot_hold_a_render_past_its_deadline(self, source):
    template = BudgetedChatTemplate(source, budget=_BUDGET)
    processes = TemplateProcesses(template, workers=1)
    self.addCleanup(processes.close)
    started = time.monotonic()
    with self.assertRaises(errors.ConversionError) as raised:
      processes.render(_MESSAGES, add_generation_prompt=True)
    self.assertLess(time.monotonic() - started, _DEADLINE_S)
    self.assertIsNotNone(raised.exception.__cause__)
    # The worker is usable again (replaced if it was killed).
    with self.assertRaises(errors.ConversionError):
      processes.render(_MESSAGES)

  def test_budget_overruns_keep_their_typed_cause(self):
    template = BudgetedChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}"
                                    "{% endfor %}{% endfor %}", budget=_BUDGET)
    processes = TemplateProcesses(template, workers=1)
    self.addCleanup(processes.close)
    with self.assertRaises(errors.ConversionError) as raised:
      processes.render(_MESSAGES)
    self.assertIsInstance(raised.exception.__cause__, TemplateBudgetExceeded)
    self.assertIn("server.template_timeout_s", raised.exception.message)

  def test_a_benign_template_renders_as_in_process(self):
    template = BudgetedChatTemplate(_BENIGN, budget=_ROOMY_BUDGET)
    processes = TemplateProcesses(template, workers=2)
    self.addCleanup(processes.close)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"q": "\ud800 é"}}}]
    cases = [dict(messages=_MESSAGES, add_generation_prompt=True),
             dict(messages=_MESSAGES * 3, tools=tools, extra="日本 😀"),
             dict(messages=[])]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      rendered = list(pool.map(lambda case: processes.render(**case), cases * 4))
    self.assertEqual(rendered, [template.render(**case) for case in cases] * 4)

  def test_start_up_is_not_charged_to_the_first_render(self):
    # A template that takes longer to compile than the render deadline but renders at once.
    source = "".join("{%% if messages %%}%d{%% endif %%}" % i for i in range(20000))
    budget = TemplateBudget(seconds=0.05, max_chars=4 * 2**20)
    started = time.monotonic()
    template = BudgetedChatTemplate(source, budget=budget)
    self.assertGreater(time.monotonic() - started, budget.seconds + grace_seconds(budget))
    processes = TemplateProcesses(template, workers=1)
    self.addCleanup(processes.close)
    self.assertEqual(processes.render(_MESSAGES), template.render(_MESSAGES))

  def test_template_errors_keep_their_meaning(self):
    template = BudgetedChatTemplate("{{ raise_exception('no system role') }}", budget=_BUDGET)
    processes = TemplateProcesses(template, workers=1)
    self.addCleanup(processes.close)
    with self.assertRaisesRegex(errors.ConversionError, "no system role") as raised:
      processes.render(_MESSAGES)
    self.assertNotIsInstance(raised.exception.__cause__, TemplateBudgetExceeded)


if __name__ == "__main__":
  absltest.main()
