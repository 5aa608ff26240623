"""docs/install.md's wheels for a GPU machine without a registry, in step with pyproject.toml.

The offline install there downloads an explicit list of requirements and installs them with
`--target`, where pip ignores what is installed: every runtime dependency of dsgd must be
either in that list (with pyproject's bounds) or named as provided by the GPU image, numpy
must carry the `cuda` extra's bound, and nothing may be listed that dsgd no longer needs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "install.md"
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")
#: pip download's options that take a value
VALUED = {"-d", "--dest", "--python-version", "--platform", "--implementation", "--abi"}


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _split(requirement: str) -> tuple[str, frozenset[str]]:
    """(normalised name, its version clauses) of a requirement without markers."""
    match = REQUIREMENT.match(requirement.split(";")[0].strip())
    assert match, requirement
    clauses = frozenset(c.replace(" ", "") for c in match.group(3).split(",") if c.strip())
    return _name(match.group(1)), clauses


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _download_command() -> list[str]:
    """The tokens of docs/install.md's `pip download` command (continuation lines joined)."""
    text = DOC.read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    for block in blocks:
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            if "pip download" in line:
                return shlex.split(line, comments=True)
    raise AssertionError("docs/install.md has no `pip download` command in a sh block")


def _carried() -> dict[str, frozenset[str]]:
    tokens = _download_command()
    tokens = tokens[tokens.index("download") + 1:]
    carried, skip = {}, False
    for token in tokens:
        if skip:
            skip = False
        elif token in VALUED:
            skip = True
        elif not token.startswith("-"):
            name, clauses = _split(token)
            carried[name] = clauses
    return carried


def _provided() -> set[str]:
    line = next((ln for ln in DOC.read_text().splitlines()
                 if ln.startswith("Provided by the image")), None)
    assert line, "docs/install.md does not say which packages the GPU image provides"
    return {_name(n) for n in re.findall(r"`([^`]+)`", line)}


def test_every_runtime_dependency_is_carried_or_provided():
    carried, provided = _carried(), _provided()
    for requirement in _project()["dependencies"]:
        name, clauses = _split(requirement)
        if name in provided:
            assert name not in carried or name == "numpy", f"{name}: both provided and carried"
            continue
        assert name in carried, (f"{requirement!r} (pyproject.toml) is neither in "
                                 f"docs/install.md's pip download nor provided by the image")
        assert clauses <= carried[name], (
            f"{name}: docs/install.md downloads {sorted(carried[name])}, pyproject.toml "
            f"asks {sorted(clauses)}")


def test_numpy_carried_with_the_cuda_extras_bound():
    carried = _carried()
    assert "numpy" in carried, "the GPU image's numpy 2.5 breaks numba-cuda: carry numpy<2.5"
    bounds = [_split(r)[1] for r in _project()["optional-dependencies"]["cuda"]
              if _split(r)[0] == "numpy"]
    assert bounds, "the cuda extra no longer bounds numpy: update docs/install.md"
    assert bounds[0] <= carried["numpy"], (carried["numpy"], bounds[0])


def test_nothing_carried_that_dsgd_does_not_need():
    needed = {_split(r)[0] for r in _project()["dependencies"]}
    stale = set(_carried()) - needed
    assert not stale, f"docs/install.md downloads what pyproject.toml no longer names: {stale}"


def test_provided_packages_are_dependencies_or_the_cuda_extra():
    known = {_split(r)[0] for r in _project()["dependencies"]}
    known |= {_split(r)[0] for r in _project()["optional-dependencies"]["cuda"]}
    assert _provided() <= known, _provided() - known


def test_install_line_ignores_the_registry_and_resolution():
    text = re.sub(r"\\\n", " ", DOC.read_text())
    install = [ln for ln in text.splitlines() if "pip install" in ln and "--target" in ln]
    assert install, "docs/install.md has no `pip install --target` line"
    for flag in ("--no-index", "--no-deps", "--target deps", "wheels/*.whl"):
        assert flag in install[0], f"{flag} missing from {install[0]!r}"
    assert "pip wheel --no-deps" in text, "dsgd's own wheel is not built"
    assert "PYTHONPATH=$PWD/deps" in text
