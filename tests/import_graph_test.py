"""The package's imports go one way: no cycles, and nothing outside `models/` imports an
architecture module (ARCHITECTURE.md). The graph is read from the source with `ast`, imports
inside functions included, so a lazy import cannot hide a cycle.
"""

import ast
import pathlib

from absl.testing import absltest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mtpjax"
# Modules of `models/` every layer may import: the architecture-neutral interface.
NEUTRAL_MODELS = {"mtpjax.models", "mtpjax.models.config", "mtpjax.models.interface",
                  "mtpjax.models.registry", "mtpjax.models.kv_cache",
                  "mtpjax.models.primitives", "mtpjax.models.quantized",
                  "mtpjax.models.traffic"}
# ARCHITECTURE.md's layers, top first: a module imports only from its layer or those below.
LAYERS = (
    ("server command", ("mtpjax.serve", "mtpjax.configs")),
    ("test helpers", ("mtpjax.testing",)),
    ("entry points", ("mtpjax.server", "mtpjax.convert", "mtpjax.embedded",
                      "mtpjax.distributed", "mtpjax.warm_start")),
    ("public API", ("mtpjax.api", "mtpjax.text")),
    ("engine", ("mtpjax.engine",)),
    ("weights", ("mtpjax.loading", "mtpjax.checkpoint", "mtpjax.sharding", "mtpjax.staging",
                 "mtpjax.disk_space")),
    ("models", ("mtpjax.models",)),
    ("formats", ("mtpjax.gguf", "mtpjax.package", "mtpjax.speculative", "mtpjax.draft_window",
                 "mtpjax.runtime_options", "mtpjax.telemetry")),
    ("kernels", ("mtpjax.kernels", "mtpjax.errors")),
)
# Modules that reach models only through the registry and the interface.
ARCHITECTURE_FREE = ("mtpjax.engine", "mtpjax.api", "mtpjax.loading", "mtpjax.checkpoint",
                     "mtpjax.models.glm_names")


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
  """module -> the package modules it imports (`from a import b` counts `a.b` if a module)."""
  modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                          + ([base] if base else []))
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                   for alias in node.names]
      else:
        continue
      edges |= {t for t in targets if t in modules and t != name}
    graph[name] = edges
  return graph


def layer_of(module: str) -> int:
  """Index in LAYERS (0 is the top); the package root sits with the public API."""
  if module == "mtpjax":
    return [name for name, _ in LAYERS].index("public API")
  for index, (_, prefixes) in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return index
  raise AssertionError(f"{module} is in no layer of ARCHITECTURE.md")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle (as a closed path), or None."""
  state: dict[str, int] = {}      # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = visit(nxt)
        if cycle:
          return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


class ImportGraphTest(absltest.TestCase):

  def test_the_package_has_no_import_cycle(self):
    graph = import_graph()
    self.assertIn("mtpjax.engine.engine", graph)            # the walk sees the package
    self.assertIn("mtpjax.models.registry", graph["mtpjax.api"])
    self.assertIsNone(find_cycle(graph))

  def test_imports_go_down_the_layers(self):
    for name, edges in import_graph().items():
      for target in edges:
        self.assertGreaterEqual(layer_of(target), layer_of(name),
                                f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} "
                                f"({LAYERS[layer_of(target)][0]})")

  def test_the_detector_finds_the_cycles_the_package_once_had(self):
    """An API class living in engine/ that api.py imported lazily, and the primitives sharing
    a file with the block that combines them."""
    api_cycle = {"mtpjax.api": {"mtpjax.engine.pipeline_model"},
                 "mtpjax.engine.pipeline_model": {"mtpjax.api"}}
    layers_cycle = {"mtpjax.models.layers": {"mtpjax.models.mla"},
                    "mtpjax.models.mla": {"mtpjax.models.dsa_indexer"},
                    "mtpjax.models.dsa_indexer": {"mtpjax.models.yarn"},
                    "mtpjax.models.yarn": {"mtpjax.models.layers"}}
    self.assertEqual(find_cycle(api_cycle), ["mtpjax.api", "mtpjax.engine.pipeline_model",
                                             "mtpjax.api"])
    self.assertLen(find_cycle(layers_cycle), 5)

  def test_a_lazy_import_inside_a_function_counts(self):
    tree = ast.parse("def load():\n  from mtpjax.engine import pipeline_model\n")
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    self.assertLen(found, 1)      # what import_graph reads, whatever the nesting

  def test_engine_and_loaders_import_no_architecture_module(self):
    graph = import_graph()
    architecture = {m for m in graph if m.startswith("mtpjax.models.")} - NEUTRAL_MODELS
    self.assertIn("mtpjax.models.glm4_moe", architecture)
    for name, edges in graph.items():
      if name.startswith(ARCHITECTURE_FREE):
        self.assertFalse(edges & architecture, f"{name} imports {sorted(edges & architecture)}")


if __name__ == "__main__":
  absltest.main()
