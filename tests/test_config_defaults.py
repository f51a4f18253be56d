"""Every setting's default is defined once, in the config tree (moeserve/config.py).

A component that carries a setting under the tree's name (a dataclass field, a constructor or
function parameter) either requires it, defaults it to None (meaning "not set"), or takes the
tree's own default (`default_of(Section, name)`): never a number of its own, which would drift
from the tree's (as `max_num_seqs` once did: 16 in the tree, 32, 64 and 8 elsewhere).
"""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel

from moeserve import config as tree

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moeserve", "model_shards", "router_service", "deployments")
# Names too general to be read as the tree's setting wherever they appear (a tensor's device or
# dtype, a file's path, a deployment's name, ...).
GENERIC = {"path", "name", "dtype", "device", "draft", "strategy", "overflow", "placement", "resources",
           "num_cpus", "num_gpus", "num_tokens", "adaptive", "compile"}


def settings() -> set[str]:
    names = set()
    for obj in vars(tree).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == tree.__name__:
            names |= {n for n, f in obj.model_fields.items()
                      if not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))}
    return names - GENERIC


def _own_default(value: ast.expr | None) -> bool:
    if value is None or (isinstance(value, ast.Constant) and value.value is None):
        return False
    return not (isinstance(value, ast.Call) and getattr(value.func, "id", "") == "default_of")


def defaults_outside_the_tree(source: str, names: set[str]) -> list[str]:
    """'line N: name = default' for every own default of a setting in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names:
            if _own_default(node.value):
                found.append(f"line {node.lineno}: {node.target.id} = {ast.unparse(node.value)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += list(zip(a.kwonlyargs, a.kw_defaults))
            found += [f"line {node.lineno}: {node.name}({arg.arg}={ast.unparse(d)})"
                      for arg, d in pairs if arg.arg in names and _own_default(d)]
    return found


def test_the_scanner_sees_fields_and_parameters():
    names = {"max_num_seqs", "block_size"}
    source = ("class C:\n    max_num_seqs: int = 32\n    block_size: int = default_of(S, 'block_size')\n"
              "def f(x, max_num_seqs=8, *, block_size=None):\n    pass\n"
              "def g(*, max_num_seqs=4):\n    pass\n")
    assert sorted(defaults_outside_the_tree(source, names)) == [
        "line 2: max_num_seqs = 32", "line 4: f(max_num_seqs=8)", "line 6: g(max_num_seqs=4)"]


def test_every_setting_default_is_the_trees():
    names = settings()
    assert {"max_num_seqs", "block_size", "kv_budget_tokens", "request_timeout_s"} <= names
    tree_file = ROOT / "moeserve" / "config.py"
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != tree_file:
                found += [f"{path.relative_to(ROOT)} {hit}"
                          for hit in defaults_outside_the_tree(path.read_text(), names)]
    assert not found, "defaults of config-tree settings outside moeserve/config.py:\n" + "\n".join(found)
