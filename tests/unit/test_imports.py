"""The package's import graph: no module imports itself back through others (at any depth, lazy
function-level imports included), and production code never imports the test helpers."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_kl

ROOT = Path(megatron_kl.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_production_code_does_not_import_testing():
    """megatron_kl.testing (SGLang test server, rank spawning for tests) and megatron_kl.validation (the node
    checks, pytest modules) are imported by nothing the trainer, the engines or the launcher run; no module of
    the package imports the repository's tests/ (an installed package has none)."""
    helpers = ("megatron_kl.testing", "megatron_kl.validation")
    offenders = {name: sorted(t for t in targets if t.startswith(helpers))
                 for name, targets in _graph().items() if not name.startswith(helpers)}
    assert {k: v for k, v in offenders.items() if v} == {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path} imports {names}"


# The package's layers, bottom first: a module may import its own layer and the ones below, never one above. A module
# belongs to the layer of the longest prefix that names it.
LAYERS = (
    ("foundations", ("megatron_kl", "megatron_kl.constraints", "megatron_kl.redaction", "megatron_kl.env_vars", "megatron_kl.child_processes", "megatron_kl.local_ranks",
                     "megatron_kl.megatron_compat", "megatron_kl.cli_help", "megatron_kl.data")),
    ("configuration", ("megatron_kl.config", "megatron_kl.model_variants", "megatron_kl.kl.config", "megatron_kl.vocab_parallel.config", "megatron_kl.launch.config",
                       "megatron_kl.distill.config")),
    ("vocab-parallel statistics", ("megatron_kl.vocab_parallel",)),
    ("KL objective", ("megatron_kl.kl",)),
    ("KL audit", ("megatron_kl.kl.audit",)),
    ("models and tasks", ("megatron_kl.models", "megatron_kl.tasks")),
    ("algorithms and rollouts", ("megatron_kl.algo", "megatron_kl.rollout", "megatron_kl.rewards")),
    ("run plumbing", ("megatron_kl.run",)),
    ("training", ("megatron_kl.train", "megatron_kl.distill", "megatron_kl.testing", "megatron_kl.validation", "megatron_kl.api")),
    ("studies", ("megatron_kl.study", "megatron_kl.config_reference")),
    ("launching", ("megatron_kl.launch",)),
    ("commands", ("megatron_kl.cli",)),
)


def layer_of(module: str) -> int:
    best, depth = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def imports_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                  for a, targets in graph.items() for t in targets if layer_of(t) > layer_of(a))


def test_every_import_runs_down_the_layers():
    assert imports_up(_graph()) == []


def test_the_layer_check_sees_a_planted_import_up():
    graph = _graph()
    graph["megatron_kl.kl.objective"] = graph["megatron_kl.kl.objective"] | {"megatron_kl.algo.losses"}
    graph["megatron_kl.vocab_parallel.truncation"] = graph["megatron_kl.vocab_parallel.truncation"] | {"megatron_kl.kl.rpg"}
    assert imports_up(graph) == [
        "megatron_kl.kl.objective (KL objective) imports megatron_kl.algo.losses (algorithms and rollouts)",
        "megatron_kl.vocab_parallel.truncation (vocab-parallel statistics) imports megatron_kl.kl.rpg (KL objective)"]
