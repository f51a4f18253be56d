"""A small, exact subset of `kustomize build`, for machines without kubectl or kustomize.

The overlays in k8s/ only use what is implemented here: `resources` (files and other
kustomizations), `namespace`, `labels` (metadata only, never selectors), `images`
(newName / newTag / digest) and `patches` whose files are JSON 6902 operation lists with a
`target`. JSON 6902 is fully specified, so this builder and kustomize agree on it; where
kubectl is installed a test checks that they do. Anything else in a kustomization is an
error here, so an overlay that outgrows this subset fails loudly instead of being built
half-way.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

_SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}
_CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}


def build(kustomization_dir: str | Path) -> list[dict[str, Any]]:
    """The objects that `kustomize build DIR` would print, in the same order."""
    root = Path(kustomization_dir)
    kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(kust) - _SUPPORTED
    if unknown:
        raise ValueError(f"{root}/kustomization.yaml: kustomize_lite does not implement {sorted(unknown)}")

    objects: list[dict[str, Any]] = []
    for entry in kust.get("resources", []):
        path = root / entry
        if path.is_dir():
            objects.extend(build(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)

    for patch in kust.get("patches", []):
        ops = yaml.safe_load((root / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise ValueError(f"{patch['path']}: only JSON 6902 patches (a list of operations) are supported")
        targets = [o for o in objects if _matches(o, patch.get("target") or {})]
        if not targets:
            raise ValueError(f"{patch['path']}: target {patch.get('target')} matches no object")
        for obj in targets:
            for op in ops:
                apply_op(obj, op)

    for image in kust.get("images", []):
        for obj in objects:
            _set_images(obj, image)

    if "namespace" in kust:
        for obj in objects:
            if obj.get("kind") not in _CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = kust["namespace"]

    for label_set in kust.get("labels", []):
        if label_set.get("includeSelectors") or label_set.get("includeTemplates"):
            raise ValueError("kustomize_lite: labels are applied to metadata only")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(label_set["pairs"])
    return objects


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    unknown = set(target) - {"group", "version", "kind", "name"}
    if unknown:
        raise ValueError(f"kustomize_lite: patch target keys {sorted(unknown)} are not implemented")
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    wanted = {"group": group, "version": version, "kind": obj.get("kind"), "name": obj["metadata"]["name"]}
    return all(wanted[k] == v for k, v in target.items())


def _set_images(node: Any, image: dict[str, Any]) -> None:
    """Rewrite `image:` of every container whose image name is image["name"] (any depth)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    if isinstance(container, dict) and "image" in container:
                        container["image"] = _rewrite(container["image"], image)
            _set_images(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, image)


def _rewrite(ref: str, image: dict[str, Any]) -> str:
    name, tag = ref, ""
    if "@" in name:
        name, tag = name.split("@", 1)
        tag = "@" + tag
    elif ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
        tag = ":" + tag
    if name != image["name"]:
        return ref
    name = image.get("newName", name)
    if "digest" in image:
        tag = "@" + image["digest"]
    elif "newTag" in image:
        tag = ":" + str(image["newTag"])
    return name + tag


# --- JSON 6902 (RFC 6902) on plain dicts and lists -------------------------------------


def apply_op(doc: dict[str, Any], op: dict[str, Any]) -> None:
    """Apply one RFC 6902 operation in place (add, remove, replace, copy, move, test)."""
    kind = op["op"]
    if kind == "test":
        if _get(doc, op["path"]) != op["value"]:
            raise ValueError(f"test failed at {op['path']}")
    elif kind == "remove":
        _remove(doc, op["path"])
    elif kind == "add":
        _add(doc, op["path"], copy.deepcopy(op["value"]))
    elif kind == "replace":
        _remove(doc, op["path"])
        _add(doc, op["path"], copy.deepcopy(op["value"]))
    elif kind == "copy":
        _add(doc, op["path"], copy.deepcopy(_get(doc, op["from"])))
    elif kind == "move":
        value = _get(doc, op["from"])
        _remove(doc, op["from"])
        _add(doc, op["path"], value)
    else:
        raise ValueError(f"unknown JSON patch op {kind!r}")


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {path!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    tokens = _tokens(path)
    if not tokens:
        raise ValueError("the whole document cannot be patched")
    node = doc
    for token in tokens[:-1]:
        node = node[int(token)] if isinstance(node, list) else node[token]
    return node, tokens[-1]


def _get(doc: Any, path: str) -> Any:
    node = doc
    for token in _tokens(path):
        node = node[int(token)] if isinstance(node, list) else node[token]
    return node


def _add(doc: Any, path: str, value: Any) -> None:
    parent, key = _parent(doc, path)
    if isinstance(parent, list):
        if key == "-":
            parent.append(value)
        else:
            index = int(key)
            if not 0 <= index <= len(parent):
                raise IndexError(f"{path}: index out of range")
            parent.insert(index, value)
    else:
        parent[key] = value


def _remove(doc: Any, path: str) -> None:
    parent, key = _parent(doc, path)
    if isinstance(parent, list):
        del parent[int(key)]
    elif key in parent:
        del parent[key]
    else:
        raise KeyError(f"{path}: no such member")
