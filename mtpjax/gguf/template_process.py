"""Chat templates rendered in child processes that are killed at the deadline.

The render budget (`template_budget.py`) is checked between a template's operations, but one
filter call is one operation: `sum` over lists, `groupby` or `sort` over a few million items
ran for 18-120 s against a 1 s budget, holding a server's prompt thread all along. A thread
cannot be stopped; a process can. So the server renders in children (`python -m
mtpjax.gguf.template_process`, which imports jinja2 and this package's template code, not
JAX): each request goes as one JSON line, the reply comes back as one, and a child that has
not answered by the budget plus a grace period is killed and replaced. A child's start-up
(interpreter, imports, compiling the template) is not charged to the first render's budget: it
says when it is ready. The children also cap their memory, so a template that builds a huge
value fails instead of swapping the host, and run below the engine's CPU priority.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import resource
import select
import subprocess
import sys
import time
from typing import Any, Mapping, Sequence

from mtpjax.gguf.template_budget import BudgetedChatTemplate, TemplateBudget, TemplateBudgetExceeded

# A child's address space: the interpreter, jinja2 and tokenizers, plus room for big renders.
MEMORY_LIMIT_BYTES = 4 * 2**30
# A child's start-up on a loaded host (interpreter, jinja2, the template's compile).
STARTUP_TIMEOUT_S = 60.0
# Below the engine, not the lowest: at nice 19 a busy CPU engine starved benign renders of
# milliseconds past a budget of seconds.
CHILD_NICENESS = 5
_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def grace_seconds(budget: TemplateBudget) -> float:
  """Time past the budget before a child is killed: its own clock usually stops the render
  first, with a clear message; the kill is for a call its clock cannot interrupt, and every
  moment of grace is a moment a prompt thread is held."""
  return max(0.25, budget.seconds / 4)


class _Child:
  """One render process and the unread part of its output."""

  def __init__(self, setup: bytes):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
    self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env)
    self._pending = b""
    self._ready = False
    self.process.stdin.write(setup)
    self.process.stdin.flush()

  def ready(self) -> bool:
    """Whether the child has finished starting (waiting up to STARTUP_TIMEOUT_S once)."""
    if not self._ready:
      self._ready = self._reply(STARTUP_TIMEOUT_S) is not None
    return self._ready

  def ask(self, line: bytes, timeout_s: float) -> dict[str, Any] | None:
    """The child's reply to `line`, or None if it died or did not answer in time."""
    try:
      self.process.stdin.write(line)
      self.process.stdin.flush()
    except OSError:
      return None
    return self._reply(timeout_s)

  def _reply(self, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    fd = self.process.stdout.fileno()
    while b"\n" not in self._pending:
      remaining = deadline - time.monotonic()
      if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
        return None
      chunk = os.read(fd, 1 << 20)
      if not chunk:
        return None
      self._pending += chunk
    reply, _, self._pending = self._pending.partition(b"\n")
    return json.loads(reply)

  def kill(self) -> None:
    self.process.kill()
    self.process.wait()
    for stream in (self.process.stdin, self.process.stdout):
      stream.close()


class TemplateProcesses:
  """`template` rendered by `workers` child processes, under its budget with no escape; used
  where `ChatTemplate.render` is (same arguments, same errors)."""

  def __init__(self, template: BudgetedChatTemplate, workers: int):
    self.template = template
    self._setup = _line({"source": template.source, "bos_token": template.bos_token,
                         "eos_token": template.eos_token, "seconds": template.budget.seconds,
                         "max_chars": template.budget.max_chars})
    self._idle: queue.Queue[_Child] = queue.Queue()
    for _ in range(workers):
      self._idle.put(_Child(self._setup))

  def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
             tools: Sequence[Mapping[str, Any]] | None = None, **template_vars: Any) -> str:
    child = self._idle.get()
    if not child.ready():
      died = self._replace(child)
      raise self.template.error(f"the chat template's render process did not start within "
                                f"{STARTUP_TIMEOUT_S:g} s (exit code {died})")
    request = _line({"messages": messages, "add_generation_prompt": add_generation_prompt,
                     "tools": tools, "template_vars": template_vars})
    budget = self.template.budget
    reply = child.ask(request, budget.seconds + grace_seconds(budget))
    if reply is None:
      died = self._replace(child)
      if died is not None:
        raise self.template.error(f"the chat template's render process died (exit code {died})")
      raise self.template.error(
          "chat template raised an error: the chat template ran past its time budget of "
          f"{budget.seconds:g} s (server.template_timeout_s) and was stopped"
      ) from TemplateBudgetExceeded("killed at the deadline")
    self._idle.put(child)
    if "text" in reply:
      return reply["text"]
    cause = TemplateBudgetExceeded(reply["error"]) if reply["over_budget"] else None
    raise self.template.error(reply["error"]) from cause

  def _replace(self, child: _Child) -> int | None:
    """Kills `child` and starts another in its place; the exit code if it had died."""
    died = child.process.poll()
    child.kill()
    self._idle.put(_Child(self._setup))
    return died

  def close(self) -> None:
    while not self._idle.empty():
      self._idle.get().kill()


def _line(value: Any) -> bytes:
  return json.dumps(value).encode() + b"\n"


def _serve(stdin, stdout) -> None:
  """The child: one setup line answered by a ready line, then a reply line for each request
  line. It runs below the engine's CPU priority: a render running out its budget should not
  take a core from decoding."""
  resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
  os.nice(CHILD_NICENESS)
  setup = json.loads(stdin.readline())
  template = BudgetedChatTemplate(
      setup["source"], bos_token=setup["bos_token"], eos_token=setup["eos_token"],
      budget=TemplateBudget(seconds=setup["seconds"], max_chars=setup["max_chars"]))
  stdout.write(_line({"ready": True}))
  stdout.flush()
  for line in stdin:
    request = json.loads(line)
    try:
      reply = {"text": template.render(request["messages"],
                                       add_generation_prompt=request["add_generation_prompt"],
                                       tools=request["tools"], **request["template_vars"])}
    except Exception as e:   # ConversionError from the template; MemoryError and the like
      reply = {"error": getattr(e, "message", f"chat template failed: {type(e).__name__}"),
               "over_budget": isinstance(e.__cause__, TemplateBudgetExceeded)}
    stdout.write(_line(reply))
    stdout.flush()


if __name__ == "__main__":
  _serve(sys.stdin.buffer, sys.stdout.buffer)
