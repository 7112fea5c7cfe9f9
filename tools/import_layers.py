"""The package's import graph and its layers, read with ``ast`` (nothing is imported), and the drawing of them in
docs/architecture.md: one row per layer, bottom first, one box per package, an arrow per pair of packages that
import each other's modules (at module level or inside functions), its width the number of imports.

    python tools/import_layers.py docs/figures/architecture-layers.png   # prints the arrows, draws the figure

tests/unit/test_imports.py holds the rules on this graph: no cycles, no import up a layer.
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "megatron_kl"

# The package's layers, bottom first: a module may import its own layer and the ones below, never one above. A module
# belongs to the layer of the longest prefix that names it; each prefix is one box of the drawing.
LAYERS = (
    (
        "foundations",
        (
            "megatron_kl",
            "megatron_kl.constraints",
            "megatron_kl.registry",
            "megatron_kl.redaction",
            "megatron_kl.env_vars",
            "megatron_kl.child_processes",
            "megatron_kl.local_ranks",
            "megatron_kl.megatron_compat",
            "megatron_kl.cli_help",
            "megatron_kl.data",
        ),
    ),
    (
        "configuration",
        (
            "megatron_kl.config",
            "megatron_kl.model_variants",
            "megatron_kl.kl.config",
            "megatron_kl.vocab_parallel.config",
            "megatron_kl.distill.config",
        ),
    ),
    ("vocab-parallel statistics", ("megatron_kl.vocab_parallel",)),
    ("KL objective", ("megatron_kl.kl",)),
    ("KL audit", ("megatron_kl.kl.audit",)),
    ("models and tasks", ("megatron_kl.models", "megatron_kl.tasks")),
    ("algorithms and rollouts", ("megatron_kl.algo", "megatron_kl.rollout", "megatron_kl.rewards")),
    ("run plumbing", ("megatron_kl.run",)),
    (
        "training",
        (
            "megatron_kl.train",
            "megatron_kl.distill",
            "megatron_kl.testing",
            "megatron_kl.validation",
            "megatron_kl.api",
        ),
    ),
    ("studies", ("megatron_kl.study", "megatron_kl.config_reference")),
    ("launching", ("megatron_kl.launch",)),
    ("commands", ("megatron_kl.cli",)),
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST, modules) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [
            f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
            for alias in node.names
        ]
    return []


def module_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its text)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            graph[name].update(t for t in _targets(node, modules) if t in modules and t != name)
    return graph


def box_of(module: str) -> tuple[int, str]:
    """(layer index, the prefix naming the module): the longest prefix wins."""
    best, depth = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = (index, prefix), prefix.count(".")
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS in tools/import_layers.py")
    return best


def layer_of(module: str) -> int:
    return box_of(module)[0]


def imports_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
        for a, targets in graph.items()
        for t in targets
        if layer_of(t) > layer_of(a)
    )


def box_arrows(graph: dict[str, set[str]]) -> collections.Counter:
    """(importing box, imported box) -> number of module pairs, boxes apart."""
    arrows: collections.Counter = collections.Counter()
    for a, targets in graph.items():
        for t in targets:
            if box_of(a)[1] != box_of(t)[1]:
                arrows[(box_of(a)[1], box_of(t)[1])] += 1
    return arrows


def draw(graph: dict[str, set[str]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = collections.Counter()
    for path in ROOT.rglob("*.py"):
        lines[box_of(module_name(path))[1]] += len(path.read_text().splitlines())
    position = {}
    for row, (_, prefixes) in enumerate(LAYERS):
        shown = [p for p in prefixes if lines[p]]
        for column, prefix in enumerate(shown):
            position[prefix] = ((column + 0.5) / len(shown), row)
    fig, ax = plt.subplots(figsize=(12, 9))
    for (a, t), count in box_arrows(graph).items():
        (xa, ya), (xt, yt) = position[a], position[t]
        ax.annotate(
            "",
            xy=(xt, yt + 0.18),
            xytext=(xa, ya - 0.18),
            arrowprops=dict(
                arrowstyle="->", lw=0.4 + 0.25 * count**0.5, alpha=0.35, color="tab:red" if yt > ya else "tab:gray"
            ),
        )
    for prefix, (x, y) in position.items():
        label = prefix.removeprefix("megatron_kl.").replace("megatron_kl", "__init__") + f"\n{lines[prefix]} lines"
        ax.text(
            x,
            y,
            label,
            ha="center",
            va="center",
            fontsize=8,
            bbox=dict(boxstyle="round", facecolor="white", edgecolor="tab:blue"),
        )
    ax.set_yticks(range(len(LAYERS)), [name for name, _ in LAYERS])
    ax.set_xticks([])
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.6, len(LAYERS) - 0.4)
    ax.set_title("megatron_kl: layers bottom up, arrows from importer to imported (red: up a layer)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


STDLIB = frozenset(sys.stdlib_module_names)


def _module_level_imports(tree: ast.Module, modules) -> list[str]:
    """What importing the module runs: imports outside function bodies and ``if TYPE_CHECKING:`` blocks."""
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            found.extend(_targets(node, modules))
            for name in ("body", "orelse", "finalbody", "handlers"):
                visit([n for n in getattr(node, name, ()) if isinstance(n, ast.AST)])

    visit(tree.body)
    return found


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def needless_function_imports(root: Path = ROOT) -> list[str]:
    """Imports inside functions that load nothing the module has not loaded already.

    The rule (docs/extending.md): an import goes inside a function only to defer an optional or heavy third-party
    package (torch, megatron-core, transformers, vLLM, SGLang, matplotlib, ...). So a function-level import is needless
    when the third-party packages it would load, itself or through the package's modules it imports at module level,
    are all loaded by the importing module's own module-level imports already: the standard library always is.
    megatron-core's modules are the exception: they are imported where they are used, after
    ``megatron_compat.apply_cpu_shims()`` has patched what megatron-core needs on a CPU machine.
    """
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    trees = {name: ast.parse(path.read_text()) for name, path in paths.items()}
    top = {name: _module_level_imports(tree, paths) for name, tree in trees.items()}
    loaded: dict[str, frozenset] = {}

    def third_party(module: str) -> frozenset:
        """The third-party top-level packages importing ``module`` loads."""
        if module.split(".")[0] != root.name:
            return frozenset({module.split(".")[0]}) - STDLIB
        if module not in loaded:
            seen, stack, found = set(), [m for m in _with_parents(module) if m in paths], set()
            while stack:
                name = stack.pop()
                if name in seen:
                    continue
                seen.add(name)
                for target in top[name]:
                    if target.split(".")[0] == root.name:
                        stack.extend(m for m in _with_parents(target) if m in paths)
                    else:
                        found.add(target.split(".")[0])
            loaded[module] = frozenset(found) - STDLIB
        return loaded[module]

    needless = []
    for name, tree in trees.items():
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested = {
                    id(n)
                    for inner in ast.walk(function)
                    if inner is not function and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(inner)
                }
                for node in ast.walk(function):
                    for target in _targets(node, paths) if id(node) not in nested else ():
                        if target.startswith("megatron.") or target == "megatron":
                            continue  # megatron-core: imported after megatron_compat.apply_cpu_shims() has run
                        if third_party(target) <= third_party(name):
                            needless.append(
                                f"{paths[name].relative_to(root.parent)}:{node.lineno} "
                                f"{function.name}() imports {target}"
                            )
    return sorted(set(needless))


def main(argv: list[str]) -> int:
    graph = module_graph()
    for (a, t), count in sorted(box_arrows(graph).items()):
        print(f"{a} -> {t}: {count}")
    up = imports_up(graph)
    print(f"{sum(len(t) for t in graph.values())} imports between {len(graph)} modules; {len(up)} run up a layer")
    if argv:
        draw(graph, Path(argv[0]))
    return 1 if up else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
