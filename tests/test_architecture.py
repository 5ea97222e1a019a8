"""The shape of the code: no import circles, no private names across modules, small files, and
the light searches without the RL stack. Read from the source with ``ast``, not by importing."""

from __future__ import annotations

import ast
import os
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
MAX_LINES = 450


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


def test_every_library_file_is_under_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) >= MAX_LINES
    }
    assert not long, f"files of {MAX_LINES} lines or more: {long}"


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
