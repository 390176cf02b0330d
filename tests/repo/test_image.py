"""The task image as a cluster's image builder makes it, checked here without building it: its pip
layers, resolved in order from PyPI for the image's platform, give one consistent set of packages,
and the build targets linux/amd64 only.

The resolve reads package metadata only (`pip install --dry-run --report`, nothing downloaded
but metadata): about half a minute. It uses this machine's pip configuration: PyPI, plus the local
CPU build of torch 2.13.0, which stands in for PyPI's CUDA wheel (that one pins NVIDIA packages
the PyPI mirror reachable here does not serve in full); every other package is PyPI's.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from grpo_flyte import envs

# flyte's Debian base (bookworm, glibc 2.36): wheels for any manylinux up to 2.36 install there.
# Every glibc up to 2.36 (bitsandbytes 0.50.2 is manylinux_2_24 only, for one).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(5, 37)] + [
    "manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64", "linux_x86_64"]  # fmt: skip
# What the image's Python evaluates requirement markers with.
MARKERS = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "os_name": "posix", "extra": ""}  # fmt: skip


def _resolve(requirements: list[str], index_url: str | None, tmp_path: Path) -> dict[str, dict]:
    """name -> the report's entry of each package pip would install for `requirements` in the image."""
    report = tmp_path / "report.json"
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
               "--only-binary=:all:", *platforms, "--python-version", "3.11", "--implementation", "cp",
               "--target", str(tmp_path / "target"), "--report", str(report),
               *(["--index-url", index_url] if index_url else []), *requirements]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"the image layer {requirements} does not resolve:\n{done.stderr[-3000:]}"
    return {canonicalize_name(item["metadata"]["name"]): item for item in json.loads(report.read_text())["install"]}


def _layered_install(image, tmp_path: Path) -> dict[str, dict]:
    """The packages of the image after its pip layers, each installed over the one before (a
    later layer replaces the versions it resolves), on flyte's base (flyte itself)."""
    installed = _resolve([f"flyte=={importlib.metadata.version('flyte')}"], None, tmp_path)
    for layer in image._layers:  # flyte keeps the layers in build order; no public accessor
        if type(layer).__name__ == "PipPackages":
            installed.update(_resolve(list(layer.packages), layer.index_url, tmp_path))
    return installed


def _unmet(installed: dict[str, dict]) -> list[str]:
    """Each requirement of an installed package that the installed versions do not meet."""
    unmet = []
    for name, item in installed.items():
        for line in item["metadata"].get("requires_dist", []):
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(MARKERS):
                continue
            have = installed.get(canonicalize_name(requirement.name))
            if have is None or not requirement.specifier.contains(have["metadata"]["version"], prereleases=True):
                unmet.append(f"{name} needs {line}; the image has {have['metadata']['version'] if have else 'none'}")
    return unmet


def test_the_image_layers_resolve_to_one_consistent_set(tmp_path):
    installed = _layered_install(envs.image, tmp_path)
    version = {name: item["metadata"]["version"] for name, item in installed.items()}
    torch = version["torch"].split("+")[0]  # 2.13.0+cpu: the stand-in (see the module docstring)
    assert (version["vllm"], torch, version["transformers"]) == (
        envs.VLLM_VERSION,
        envs.TORCH_VERSION,
        envs.TRANSFORMERS_VERSION,
    )
    assert _unmet(installed) == []
    # FlashInfer's packages must have one version (`import flashinfer` raises otherwise), vLLM's pin
    flashinfer = {name: v for name, v in version.items() if name.startswith("flashinfer")}
    pins = [Requirement(line) for line in installed["vllm"]["metadata"]["requires_dist"] if line.startswith("flashinfer-python")]
    assert all(pin.specifier.contains(flashinfer["flashinfer-python"]) for pin in pins)
    assert len(set(flashinfer.values())) == 1, flashinfer


_DRY_BUILD = """
import asyncio, os
os.environ["FLYTE_DOCKER_BUILDKIT_BUILDER_NAME"] = "offline"  # no buildx builder is looked up
from flyte._internal.imagebuild.docker_builder import DockerImageBuilder
from grpo_flyte import envs
image = envs.build_image(envs.DeploySettings(registry="registry.example.com/team"))
asyncio.run(DockerImageBuilder().build_image(image, dry_run=True))
"""


def test_a_local_build_targets_linux_amd64_only(tmp_path):
    """flyte's Docker builder, as a dry run: the build command and the Dockerfile it would use."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_FLYTE_")}
    done = subprocess.run(
        [sys.executable, "-c", _DRY_BUILD], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [command] = [line for line in done.stdout.splitlines() if line.startswith("Command: docker buildx build")]
    assert command.split("--platform ", 1)[1].split()[0] == "linux/amd64"
    assert "flashinfer" not in done.stdout.lower()  # no FlashInfer layer of our own (vLLM pins its one)
