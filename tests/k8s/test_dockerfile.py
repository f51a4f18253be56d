"""Static checks of the Dockerfile (no Docker engine is needed): versions agree with the
manifests and the setup script, no host is hardcoded, the build context has what it copies."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re

from tests.k8s.manifests import REPO, build, one

DOCKERFILE = (REPO / "Dockerfile").read_text()


def arg_default(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S*)$", DOCKERFILE, re.M)
    assert match, f"ARG {name} not found"
    return match.group(1).strip('"')


def test_ray_version_matches_the_manifest_and_this_environment() -> None:
    ray_version = arg_default("RAY_VERSION")
    assert one(build("base"), "RayService")["spec"]["rayClusterConfig"]["rayVersion"] == ray_version
    assert importlib.metadata.version("ray") == ray_version


def test_torch_and_xgrammar_versions_match_the_setup_script() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    for arg, var in (("TORCH_VERSION", "TORCH_VERSION"), ("XGRAMMAR_VERSION", "XGRAMMAR_VERSION")):
        assert re.search(rf'^{var}="{re.escape(arg_default(arg))}"$', setup, re.M), arg


def test_no_host_is_hardcoded() -> None:
    assert "://" not in DOCKERFILE
    assert arg_default("TORCH_INDEX_URL") == ""


def test_runs_as_a_numeric_non_root_user_with_no_entrypoint() -> None:
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    # KubeRay replaces the command with its own `ray start`; an ENTRYPOINT would wrap it.
    assert not re.search(r"^ENTRYPOINT", DOCKERFILE, re.M)
    assert re.search(r"^FROM python:3\.11-slim$", DOCKERFILE, re.M)


def test_torch_is_installed_before_the_project() -> None:
    torch_at = DOCKERFILE.index('pip install "torch==')
    assert torch_at < DOCKERFILE.index("pip install -r") < DOCKERFILE.index("pip install --no-deps -e .")
    assert 'pip install --no-deps "xgrammar==' in DOCKERFILE


def test_the_build_context_holds_what_is_copied() -> None:
    """Every COPY source exists and survives .dockerignore (a whitelist: '*' then '!path')."""
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for rule in rules:
            negate, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
                keep = negate
        return keep

    sources = [src for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M) for src in line.split()[:-1]
               if not src.startswith("--")]
    assert sources
    for src in sources:
        path = src.rstrip("/")
        assert (REPO / path).exists(), f"COPY {src}: not in the repository"
        assert included(path), f"COPY {src}: excluded by .dockerignore"
    for private in (".venv", ".git", "tests", "bench/results"):
        assert not included(private), f"{private} would be sent to the builder"
