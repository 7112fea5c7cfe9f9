"""The package's import graph: no module imports itself back through others (at any depth, lazy
function-level imports included), and production code never imports the test helpers."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_kl
from tools.import_layers import imports_up, module_graph, needless_function_imports

ROOT = Path(megatron_kl.__file__).parent


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
    assert _cycles(module_graph()) == []


def test_production_code_does_not_import_testing():
    """megatron_kl.testing (SGLang test server, rank spawning for tests) and megatron_kl.validation (the node
    checks, pytest modules) are imported by nothing the trainer, the engines or the launcher run; no module of
    the package imports the repository's tests/ (an installed package has none)."""
    helpers = ("megatron_kl.testing", "megatron_kl.validation")
    offenders = {
        name: sorted(t for t in targets if t.startswith(helpers))
        for name, targets in module_graph().items()
        if not name.startswith(helpers)
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path} imports {names}"


def test_every_import_runs_down_the_layers():
    assert imports_up(module_graph()) == []


def test_the_layer_check_sees_a_planted_import_up():
    graph = module_graph()
    graph["megatron_kl.kl.objective"] = graph["megatron_kl.kl.objective"] | {"megatron_kl.algo.losses"}
    graph["megatron_kl.vocab_parallel.truncation"] = graph["megatron_kl.vocab_parallel.truncation"] | {
        "megatron_kl.kl.rpg"
    }
    assert imports_up(graph) == [
        "megatron_kl.kl.objective (KL objective) imports megatron_kl.algo.losses (algorithms and rollouts)",
        "megatron_kl.vocab_parallel.truncation (vocab-parallel statistics) imports megatron_kl.kl.rpg (KL objective)",
    ]


def test_imports_inside_functions_defer_something():
    """An import inside a function defers an optional or heavy third-party package the module does not load already
    (docs/extending.md); anything else goes in the module's import block."""
    assert needless_function_imports() == []


def test_the_function_import_rule_sees_planted_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "light.py").write_text("import json\n")
    (package / "heavy.py").write_text("import torch\n")
    (package / "user.py").write_text(
        "import yaml\n\n"
        "def f():\n    import json\n    import pkg.light\n    import yaml\n\n"
        "def g():\n    import torch\n    import pkg.heavy\n    from megatron.core import parallel_state\n"
    )
    assert needless_function_imports(package) == [
        "pkg/user.py:4 f() imports json",
        "pkg/user.py:5 f() imports pkg.light",
        "pkg/user.py:6 f() imports yaml",
    ]
