"""Layering: Ray stays in deployments/ (the model, the gating math and the core package never
import it), and no two packages import each other.

For Ray, two checks, because each misses what the other sees: the source scan finds an import on
a path no test runs (inside a function, behind a flag); the import check finds ray
pulled in indirectly, through a helper module or a third-party package.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RAY_FREE_PACKAGES = ("moeserve", "model_shards", "router_service")


def _source_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_ray(module: str | None) -> bool:
    return module is not None and (module == "ray" or module.startswith("ray."))


def ray_imports(source: str, filename: str) -> list[str]:
    """Every import of ray in the source, as 'line N: statement'."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import) and any(_is_ray(alias.name) for alias in node.names):
            found.append(f"line {node.lineno}: import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_ray(node.module):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and _is_ray(str(node.args[0].value)):
                found.append(f"line {node.lineno}: {name}({node.args[0].value!r})")
    return found


def test_scanner_finds_every_form():
    source = (
        "import os, ray\nfrom ray import serve\nimport ray.serve as s\ndef f():\n    importlib.import_module('ray')\n"
    )
    assert len(ray_imports(source, "x.py")) == 4
    assert ray_imports("import rayon\nfrom .ray import x\nfrom array import array\n", "x.py") == []


@pytest.mark.parametrize("package", RAY_FREE_PACKAGES)
def test_source_never_imports_ray(package):
    files = _source_files(package)
    assert files, f"{package}/ has no Python files"
    offenders = {
        str(path.relative_to(ROOT)): hits
        for path in files
        if (hits := ray_imports(path.read_text(encoding="utf-8"), str(path)))
    }
    assert not offenders, f"{package}/ must not import ray (only deployments/ may): {offenders}"


_IMPORT_ALL = """
import importlib, json, sys
first_with_ray, errors = None, []
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as error:
        errors.append(f"{name}: {type(error).__name__}: {error}")
    if first_with_ray is None and any(m == "ray" or m.startswith("ray.") for m in sys.modules):
        first_with_ray = name
print(json.dumps({"first_with_ray": first_with_ray, "errors": errors}))
"""


def _import_report(modules: list[str], path: list[Path]) -> dict:
    """Import the modules one by one in a fresh interpreter; say when ray first appears."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, json.dumps(modules)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_every_module_leaves_ray_unloaded():
    modules = [
        _module_name(path)
        for package in RAY_FREE_PACKAGES
        for path in _source_files(package)
        if path.stem != "__main__"  # running it would start the CLI
    ]
    report = _import_report(modules, [ROOT])
    assert report["first_with_ray"] is None, f"importing {report['first_with_ray']} loaded ray"
    assert not report["errors"], "modules that failed to import (so could not be checked):\n" + "\n".join(
        report["errors"]
    )


def test_import_check_catches_indirect_ray(tmp_path):
    (tmp_path / "helper_with_ray.py").write_text("import ray  # noqa\n")
    (tmp_path / "innocent.py").write_text("import helper_with_ray  # noqa\n")
    report = _import_report(["json", "innocent"], [tmp_path])
    assert report["first_with_ray"] == "innocent"


def test_the_cli_imports_ray_only_to_serve():
    """`moeserve generate` runs the engine in this process: the CLI module loads no Ray."""
    report = _import_report(["deployments.cli"], [ROOT])
    assert report["first_with_ray"] is None and not report["errors"], report


# Packages whose imports form a graph that must have no cycle; moeserve's subpackages count
# apart from each other (engine, spec, grammar), its top-level modules (shared types) as moeserve.
LAYERED = ("moeserve", "model_shards", "router_service", "deployments", "bench", "demo", "tests")


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in LAYERED:
        return None
    if parts[0] == "moeserve" and len(parts) > 1 and (ROOT / "moeserve" / parts[1]).is_dir():
        return f"moeserve.{parts[1]}"
    return parts[0]


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """unit -> {unit it imports: where (first file:line)}, from every import statement, those
    inside functions included. A package's __init__.py is its public face (lazy re-exports),
    not a layer, so it is left out."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] not in LAYERED or path.name == "__init__.py" or "__pycache__" in rel.parts:
            continue
        src = _unit(".".join(rel.with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                dst = _unit(name)
                if dst is not None and dst != src:
                    graph.setdefault(src, {}).setdefault(dst, f"{rel}:{node.lineno}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str]:
    """One cycle of the graph as [a, b, ..., a], or [] if there is none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_package_imports_another_that_imports_it_back():
    graph = import_graph(ROOT)
    cycle = find_cycle(graph)
    where = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    assert not cycle, "package cycle: " + "; ".join(where)
    assert "tests" not in graph.get("bench", {}), "bench/ imports from tests/"


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    for package, imports in {"bench": "from demo.x import y", "demo": "import bench.z", "tests": ""}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "m.py").write_text(f"def f():\n    {imports or 'pass'}\n")
    graph = import_graph(tmp_path)
    assert find_cycle(graph) in (["bench", "demo", "bench"], ["demo", "bench", "demo"])
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}}) == []
