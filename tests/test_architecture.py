"""The shape of the code: imports point down docs/architecture.md's table of layers, no import
circles, no private names across modules, no library module loose in ``autoprec/`` but the
facts and the entry points, no experiment importing the CLI's internals, and the light searches
without the RL stack. Read from the source with ``ast``, not by importing."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Where each package of the installed ``autoprec`` lives (pyproject's package-dir).
PACKAGE_DIRS = {
    "autoprec": ROOT / "autoprec",
    "autoprec.envs": ROOT / "envs",
    "autoprec.agents": ROOT / "agents",
    "autoprec.kernels": ROOT / "kernels",
}
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if package == "autoprec" and parts and f"autoprec.{parts[0]}" in PACKAGE_DIRS:
                continue
            found[name] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import statement, those in
    functions included, those under ``if TYPE_CHECKING:`` left out (they never run)."""
    out: list[tuple[str, str | None, int]] = []
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, None, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                out.extend((base, a.name, child.lineno) for a in child.names)
            visit(child)

    visit(tree)
    return out


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, name, _ in _imports(ast.parse(path.read_text()), module):
            if name is not None and f"{target}.{name}" in MODULES:
                edges[module].add(f"{target}.{name}")  # from package import submodule
            elif target in MODULES:
                edges[module].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
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
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            strong(v)
    return found


def test_the_walker_sees_the_package():
    assert "autoprec.envs.precision_env" in MODULES
    assert "autoprec.kernels.formats" in MODULES
    edges = _graph()
    assert "autoprec.precision" in edges["autoprec.kernels.formats"]
    # a circle it would report
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert not cycles, "import circles (function-level imports count): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_module_imports_another_modules_private_names():
    offences = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for target, name, line in _imports(tree, module):
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            if target.startswith("autoprec") and f"{target}.{name}" not in MODULES:
                offences.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
    assert not offences, "\n".join(offences)


def _layers() -> list[tuple[str, list[str]]]:
    """``(layer, [package or module, ...])`` per row of docs/architecture.md's table, bottom
    first."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("## Layers") :].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].startswith("`autoprec"):
            continue
        rows.append((cells[0], re.findall(r"`(autoprec[\w.]*)`", cells[1])))
    return rows


def _layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The row of the longest package name that is ``module`` or one of its parents."""
    best: tuple[int, int] | None = None
    for i, (_, names) in enumerate(layers):
        for name in names:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[1]:
                    best = (i, len(name))
    return None if best is None else best[0]


def test_the_layer_table_is_read():
    layers = _layers()
    names = [layer for layer, _ in layers]
    assert names[0] == "facts" and names[-1] == "cli" and "runtime" in names
    assert _layer_of("autoprec.runtime.apply", layers) == names.index("runtime")
    assert _layer_of("autoprec.sensitivities.grade", layers) > names.index("runtime")


def test_every_module_is_in_a_layer_and_imports_point_down():
    layers = _layers()
    names = [layer for layer, _ in layers]
    unplaced = [m for m in MODULES if _layer_of(m, layers) is None]
    assert not unplaced, f"modules in no row of {ARCHITECTURE.name}'s table: {unplaced}"
    upward = []
    for module, path in MODULES.items():
        own = _layer_of(module, layers)
        for target, name, line in _imports(ast.parse(path.read_text()), module):
            if name is not None and f"{target}.{name}" in MODULES:
                target = f"{target}.{name}"
            elif target not in MODULES or (target == "autoprec" and name == "__version__"):
                continue
            theirs = _layer_of(target, layers)
            if theirs is not None and own is not None and theirs > own:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line} ({names[own]}) imports {target} "
                    f"({names[theirs]})"
                )
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_library_module_is_loose_but_the_facts_and_the_entry_points():
    layers = dict(_layers())
    allowed = {*layers["facts"], "autoprec", "autoprec.__main__"}
    loose = [
        m for m, p in MODULES.items() if p.parent == PACKAGE_DIRS["autoprec"] and m not in allowed
    ]
    assert not loose, f"modules loose in autoprec/ (put them in a package): {loose}"


def test_no_experiment_imports_the_cli():
    offences = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            if any(m == "autoprec.cli" or m.startswith("autoprec.cli.") for m in mods):
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offences, "experiments call the library, not the CLI: " + ", ".join(offences)


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["random", "tpe"])
def test_a_light_search_does_not_import_the_rl_stack(agent, tmp_path):
    """``autoprec search --agent random`` (or ``tpe``) imports neither gymnasium nor
    stable-baselines3: a whole small search runs, then the loaded modules are listed."""
    code = (
        "import sys\n"
        "from autoprec.cli import main\n"
        f"rc = main(['search', '--model', 'tinycnn', '--steps', '2', '--train-batch-size', '16',"
        f" '--agent', {agent!r}, '--budget', '2', '--no-mlflow'])\n"
        "print(rc, sorted(m for m in ('gymnasium', 'stable_baselines3', 'sb3_contrib')"
        " if m in sys.modules))\n"
    )
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert out.stdout.strip().splitlines()[-1:] == ["0 []"], out.stdout + out.stderr[-2000:]
