"""The design notes the code cites live in this repository, with the sections the citations name.

Docstrings and comments cite notes as `docs/<PAGE>.md §N` (or `§N.M`, or a bare `§N` after a
note named earlier in the same file). Every `*.md` a Python file (or a colab notebook's cell)
names must be a file of the repository: a path relative to the repository root, a page of
`docs/`, a root file (ARCHITECTURE.md, README.md), or MODEL_CARD.md, which tools/train_demo.py
writes into the packages it makes. Every section number must be a heading `## N.` / `### N.M`
of the note it follows. Paths such as `owner/repo:docs/x.md` name another repository and are not
checked. Nothing may point at the design notes or fixtures outside the repository.

Pure text scanning: no imports of the package, no JAX.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re

from absl.testing import absltest

REPO = pathlib.Path(__file__).resolve().parent.parent
THIS = pathlib.Path(__file__).resolve()
DOCS = REPO / "docs"
SOURCE_DIRS = ("mtpjax", "tools", "tests", "configs")
NOTEBOOK_DIRS = ("colab",)
# Notes at the repository root that code may name without a path.
ROOT_NOTES = ("ARCHITECTURE.md", "README.md")
# Notes written at run time, with the tool that writes them: they have no file to check here.
WRITTEN_NOTES = {"MODEL_CARD.md": "tools/train_demo.py"}

# The end of a note's name, or a section number. A note's name is the whole path that ends in
# `.md` (`docs/MODEL.md`, `../x/MODEL.md`); one with a `:` in it (`owner/repo:docs/x.md`) names
# another repository's file.
NOTE_END_OR_SECTION = re.compile(r"\.md\b|§(\d+(?:\.\d+)*)")
PATH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:-")
EXTERNAL, UNRESOLVED = "another repository", "unresolved"
HEADING = re.compile(r"^#{2,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)

# Paths to the design notes and fixtures outside the repository (the workspace folder beside a
# checkout), searched in the code and in the design notes.
_BESIDE = "shared"
OUTSIDE_PATHS = (f"../{_BESIDE}", f"{_BESIDE}/design", f"{_BESIDE}/fixtures", "../fixtures")
DESIGN_NOTES = ("README.md", "MODEL.md", "DECODE.md", "LAYER_PACKAGES.md", "SPECULATIVE.md",
                "STYLE.md")
OUTSIDE_EXEMPT = (THIS,)
TEXT_SUFFIXES = (".py", ".ipynb", ".md", ".txt", ".json", ".toml", ".cfg", ".sh", ".jinja",
                 ".cc", ".h", ".yaml", ".yml")


def citations(text: str):
  """(offset, "note", its path as written) and (offset, "section", its number), in text order."""
  for match in NOTE_END_OR_SECTION.finditer(text):
    if match.group(1) is not None:
      yield match.start(), "section", match.group(1)
      continue
    start = match.start()
    while start > 0 and text[start - 1] in PATH_CHARS:
      start -= 1
    name = text[start:match.end()]
    if name.rsplit("/", 1)[-1] != ".md":        # not a pattern such as `*.md`
      yield start, "note", name


def sections_of(note: pathlib.Path) -> frozenset[str]:
  """The numbers of a note's numbered headings (`## 2.`, `### 2.4`), code blocks excluded."""
  text = FENCE.sub("", note.read_text(encoding="utf-8"))
  return frozenset(HEADING.findall(text))


def python_files() -> list[pathlib.Path]:
  files = [path for top in SOURCE_DIRS for path in sorted((REPO / top).rglob("*.py"))]
  return [path for path in files if "__pycache__" not in path.parts and path != THIS]


def notebook_files() -> list[pathlib.Path]:
  return [path for top in NOTEBOOK_DIRS for path in sorted((REPO / top).rglob("*.ipynb"))]


@functools.cache
def scanned_texts() -> tuple[tuple[str, str], ...]:
  """(location prefix, text) of every Python file and every notebook cell that names a note or
  a section."""
  texts = [(str(path.relative_to(REPO)), path.read_text(encoding="utf-8"))
           for path in python_files()]
  for path in notebook_files():
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    for index, cell in enumerate(cells):
      source = cell.get("source", "")
      texts.append((f"{path.relative_to(REPO)} cell {index}",
                    "".join(source) if isinstance(source, list) else source))
  return tuple((where, text) for where, text in texts if ".md" in text or "§" in text)


def resolve_note(name: str) -> tuple[pathlib.Path | None, str | None]:
  """(the note's file, None), (None, None) for a note written at run time, or (None, why)."""
  base = name.rsplit("/", 1)[-1]
  if base in WRITTEN_NOTES:
    return None, None
  if "/" in name:
    path = (REPO / name).resolve()
    if not path.is_relative_to(REPO):
      return None, f"{name} is outside the repository"
    return (path, None) if path.is_file() else (None, f"{name} is not a file of the repository")
  for path in ((REPO / name) if name in ROOT_NOTES else None, DOCS / name):
    if path is not None and path.is_file():
      return path, None
  return None, f"{name} is neither docs/{name} nor a root note {ROOT_NOTES}"


def citation_problems(location: str, text: str, sections: dict) -> list[str]:
  """Every unresolved note and every section its note lacks, as `location:line: why`."""
  problems = []
  current = None    # (name, its file, or None, EXTERNAL or UNRESOLVED) of the last note named
  for offset, kind, value in citations(text):
    where = f"{location}:{text.count(chr(10), 0, offset) + 1}"
    if kind == "note" and ":" in value:
      current = (value, EXTERNAL)
      continue
    if kind == "note":
      name = value
      path, why = resolve_note(name)
      if why is not None:
        problems.append(f"{where}: {why}")
      current = (name, UNRESOLVED if why is not None else path)
      continue
    number = value
    if current is None:
      problems.append(f"{where}: §{number} follows no note named before it in the file")
    elif current[1] in (EXTERNAL, UNRESOLVED):    # not checkable, or already reported
      continue
    elif current[1] is None:
      problems.append(f"{where}: §{number} of {current[0]}, which has no file to check")
    else:
      if current[1] not in sections:
        sections[current[1]] = sections_of(current[1])
      if number not in sections[current[1]]:
        problems.append(f"{where}: {current[0]} has no section {number} "
                        f"(it has {sorted(sections[current[1]], key=_numeric)})")
  return problems


def _numeric(number: str) -> tuple[int, ...]:
  return tuple(int(part) for part in number.split("."))


class DocsReferencesTest(absltest.TestCase):

  def test_the_scan_sees_the_code(self):
    """A scan that found nothing would pass vacuously."""
    self.assertGreater(len(python_files()), 100)
    cited = [citation for _, text in scanned_texts() for citation in citations(text)]
    self.assertGreater(len(cited), 50)

  def test_every_design_note_has_numbered_sections(self):
    for name in DESIGN_NOTES:
      self.assertTrue((DOCS / name).is_file(), name)
    for name in ("MODEL.md", "DECODE.md", "LAYER_PACKAGES.md", "SPECULATIVE.md", "STYLE.md"):
      self.assertIn("1", sections_of(DOCS / name), name)

  def test_cited_notes_and_sections_exist(self):
    sections: dict = {}
    problems = [problem for location, text in scanned_texts()
                for problem in citation_problems(location, text, sections)]
    self.assertEmpty(problems, "\n" + "\n".join(problems))

  def test_written_notes_are_written_by_their_tool(self):
    for name, tool in WRITTEN_NOTES.items():
      lines = (REPO / tool).read_text(encoding="utf-8").splitlines()
      self.assertTrue(any(f'"{name}"' in line and ".write_text(" in line for line in lines),
                      f"{tool} no longer writes {name}")

  def test_the_checker_catches_bad_citations(self):
    sections: dict = {}
    good = '"""See docs/MODEL.md §7, §8-§9 and DECODE.md §3; then §4 of it."""\n'
    self.assertEmpty(citation_problems("good.py", good, sections))
    bad = ('"""docs/MODEL.md §99 and §7.4; NOTES.md §1;\n'
           f'../{_BESIDE}/design/MODEL.md §2, docs/SPECULATIVE.md §12"""\n')
    problems = citation_problems("bad.py", bad, sections)
    self.assertLen(problems, 5, problems)
    self.assertTrue(all(problem.startswith(("bad.py:1:", "bad.py:2:")) for problem in problems))
    self.assertNotEmpty(citation_problems("bare.py", "# §3 of nothing\n", sections))
    self.assertNotEmpty(citation_problems("card.py", "# MODEL_CARD.md §3\n", sections))
    external = "# Mesh-LLM/mesh-llm:docs/specs/package.md §3, docs/SPECULATIVE.md §9\n"
    self.assertEmpty(citation_problems("other.py", external, sections))

  def test_nothing_points_outside_the_repository(self):
    tops = SOURCE_DIRS + NOTEBOOK_DIRS
    paths = [path for top in tops for path in sorted((REPO / top).rglob("*"))
             if path.is_file() and path.suffix in TEXT_SUFFIXES and path not in OUTSIDE_EXEMPT
             and "__pycache__" not in path.parts]
    found = []
    for path in paths + [DOCS / name for name in DESIGN_NOTES]:
      for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace")
                                    .splitlines(), 1):
        if any(pattern in line for pattern in OUTSIDE_PATHS):
          found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    self.assertEmpty(found, "\n" + "\n".join(found))


if __name__ == "__main__":
  absltest.main()
