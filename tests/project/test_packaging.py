"""Packaging: one version everywhere, the licences in the installed wheel, and the wheel checker.

scripts/check-dist decides whether a wheel may be published (scripts/test and the release
workflow run it on every wheel); these tests feed it real extension modules with one fault
each (a newer glibc symbol version, a library outside the allow-list, another machine) and
check that it refuses them, and that the installed distribution carries what the checker
demands of a wheel.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import io
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

import corewire
from paths_support import REPO_ROOT as ROOT

tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML")


def load_script(name: str) -> ModuleType:
    """Imports scripts/<name> (a Python script without a .py suffix) as a module."""
    path = ROOT / "scripts" / name
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up by name
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def check_dist() -> ModuleType:
    """scripts/check-dist as a module."""
    return load_script("check-dist")


@pytest.fixture(scope="module")
def native_so() -> bytes:
    """The bytes of the installed extension module."""
    files = importlib.metadata.files("corewire") or []
    modules = [f for f in files if f.name.startswith("_native") and f.name.endswith(".so")]
    assert len(modules) == 1, modules
    return Path(modules[0].locate()).read_bytes()


def cargo_toml() -> dict:
    """The crate manifest: the one place the version is written."""
    with open(ROOT / "Cargo.toml", "rb") as f:
        return tomllib.load(f)


def test_one_version_in_crate_wheel_and_module() -> None:
    """Cargo.toml's version is the installed distribution's, corewire.__version__ and
    Cargo.lock's, and pyproject.toml leaves it to Cargo.toml instead of writing its own."""
    version = cargo_toml()["package"]["version"]
    assert importlib.metadata.version("corewire") == version
    assert corewire.__version__ == version
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert "version" not in project
    assert "version" in project["dynamic"]
    with open(ROOT / "Cargo.lock", "rb") as f:
        locked = [p for p in tomllib.load(f)["package"] if p["name"] == "corewire"]
    assert [p["version"] for p in locked] == [version]


def test_changelog_has_an_entry_for_this_version() -> None:
    """The first release heading of CHANGELOG.md is the version being built."""
    headings = re.findall(r"^## \[?([^\]\s]+)\]?", (ROOT / "CHANGELOG.md").read_text(), re.M)
    releases = [h for h in headings if h.lower() != "unreleased"]
    assert releases[:1] == [cargo_toml()["package"]["version"]]


def test_installed_distribution_carries_licences_and_metadata() -> None:
    """LICENSE and the third-party licences are in the installed dist-info, identical to the
    repository's; the metadata names the licence, the Python versions and py.typed."""
    dist = importlib.metadata.distribution("corewire")
    files = {str(f): f for f in dist.files or []}
    for name in ("LICENSE", "THIRD-PARTY-LICENSES.md"):
        (path,) = [f for key, f in files.items() if key.endswith(f".dist-info/licenses/{name}")]
        assert Path(path.locate()).read_text() == (ROOT / name).read_text()
    assert "corewire/py.typed" in files
    meta = dist.metadata
    assert meta["License-Expression"] == "Apache-2.0"
    classifiers = meta.get_all("Classifier") or []
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert "Typing :: Typed" in classifiers
    # PyPI refuses a licence classifier beside License-Expression.
    assert not [c for c in classifiers if c.startswith("License ::")]


@pytest.mark.skipif(shutil.which("cargo") is None, reason="needs cargo to read Cargo.lock")
def test_third_party_licences_are_current_with_cargo_lock() -> None:
    """THIRD-PARTY-LICENSES.md is what scripts/third-party-licenses writes from Cargo.lock now,
    and names Oniguruma's own licence beside the crates'."""
    run = subprocess.run(
        [sys.executable, ROOT / "scripts" / "third-party-licenses", "--check"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    text = (ROOT / "THIRD-PARTY-LICENSES.md").read_text()
    assert "| pyo3 |" in text and "| tokenizers |" in text and "| onig_sys |" in text
    assert "Oniguruma, in onig_sys" in text


def test_checker_reads_the_installed_module(check_dist: ModuleType, native_so: bytes) -> None:
    """The ELF reader finds this machine's architecture, libc among the needed libraries and
    versioned libc symbols in the module that is installed."""
    elf = check_dist.read_elf(native_so)
    assert elf.machine == check_dist.ELF_MACHINES[platform.machine()]
    assert any(lib.startswith("libc.so") for lib in elf.needed)
    if platform.libc_ver()[0] == "glibc":
        assert any(version.startswith("GLIBC_2.") for _, version in elf.versions)


def policy_for_this_machine(check_dist: ModuleType) -> object:
    libc = "manylinux2014" if platform.libc_ver()[0] == "glibc" else "musllinux_1_2"
    return check_dist.POLICIES[f"{libc}_{platform.machine()}"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="musl has no symbol versions")
def test_checker_refuses_a_newer_glibc_symbol(check_dist: ModuleType, native_so: bytes) -> None:
    """The original bug: a module that needs a newer glibc than manylinux2014's 2.17 (one
    version name in .dynstr rewritten, same length) is refused, with the version named."""
    elf = check_dist.read_elf(native_so)
    old = next(v for _, v in elf.versions if v.startswith("GLIBC_2."))
    new = "GLIBC_9" + "9" * (len(old) - len("GLIBC_9"))
    patched = native_so.replace(old.encode() + b"\0", new.encode() + b"\0")
    problems = check_dist.check_elf(
        "m.so", check_dist.read_elf(patched), policy_for_this_machine(check_dist)
    )
    assert any(new in p and "allows 2.17" in p for p in problems), problems


def test_checker_refuses_a_library_outside_the_policy(
    check_dist: ModuleType, native_so: bytes
) -> None:
    """A needed library that the policy does not allow (libc's name with one letter changed)
    is refused by name, unless the wheel carries it in corewire.libs/ (auditwheel's repair)."""
    elf = check_dist.read_elf(native_so)
    libc = next(lib for lib in elf.needed if lib.startswith("libc.so"))
    other = "libq" + libc[4:]
    patched = native_so.replace(b"\0" + libc.encode() + b"\0", b"\0" + other.encode() + b"\0")
    policy = policy_for_this_machine(check_dist)
    problems = check_dist.check_elf("m.so", check_dist.read_elf(patched), policy)
    assert any(f"needs {other}," in p for p in problems), problems
    bundled = check_dist.check_elf("m.so", check_dist.read_elf(patched), policy, frozenset({other}))
    assert not [p for p in bundled if f"needs {other}," in p], bundled


def test_checker_refuses_another_machine(check_dist: ModuleType, native_so: bytes) -> None:
    """An aarch64 wheel holding an x86_64 module (or the reverse) is refused."""
    other = "aarch64" if platform.machine() == "x86_64" else "x86_64"
    problems = check_dist.check_elf(
        "m.so", check_dist.read_elf(native_so), check_dist.POLICIES[f"manylinux2014_{other}"]
    )
    assert any("ELF machine" in p for p in problems), problems
    with pytest.raises(check_dist.ElfError):
        check_dist.read_elf(b"#!/bin/sh\n" + native_so)


def test_checker_refuses_a_wheel_tagged_for_a_newer_glibc(
    check_dist: ModuleType, native_so: bytes, tmp_path: Path
) -> None:
    """A wheel named for the build machine's glibc (manylinux_2_34, what a plain `maturin build`
    here makes) is refused before anything else, and --expect pins the platform."""
    version = cargo_toml()["package"]["version"]
    newer = tmp_path / f"corewire-{version}-cp310-abi3-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(newer, "w") as wheel:
        wheel.writestr("corewire/_native.abi3.so", native_so)
    problems, _ = check_dist.check_wheel(newer, None)
    assert problems and "manylinux_2_34_x86_64 is none of" in problems[0]
    assert check_dist.main([str(newer)]) == 1
    renamed = tmp_path / f"corewire-{version}-cp310-abi3-musllinux_1_2_x86_64.whl"
    newer.rename(renamed)
    problems, _ = check_dist.check_wheel(renamed, "manylinux2014_x86_64")
    assert "expected manylinux2014_x86_64" in " ".join(problems)


def test_release_workflow_builds_every_platform_the_checker_knows(check_dist: ModuleType) -> None:
    """The release workflow's matrix is exactly the four platforms check-dist accepts, and
    each is tested with scripts/test --wheel (where their checks are defined)."""
    workflow = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    platforms = re.findall(r"^\s+- platform: (\S+)$", workflow, re.M)
    assert sorted(platforms) == sorted(check_dist.POLICIES)
    assert "scripts/test --wheel dist/*.whl ${{ matrix.platform }}" in workflow
    assert "scripts/test --sdist dist/*.tar.gz" in workflow


@pytest.mark.skipif(shutil.which("maturin") is None, reason="needs maturin to build the sdist")
def test_sdist_carries_the_build_inputs_and_nothing_else(
    check_dist: ModuleType, tmp_path: Path
) -> None:
    """`maturin sdist` of this tree passes check-dist; the same sdist with a test module
    added, or without Cargo.lock, does not."""
    subprocess.run(
        ["maturin", "sdist", "--out", tmp_path / "out", "--manifest-path", ROOT / "Cargo.toml"],
        check=True,
        capture_output=True,
    )
    (sdist,) = (tmp_path / "out").iterdir()
    assert check_dist.check_sdist(sdist)[0] == []
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as original:
        members = [(m, original.extractfile(m).read()) for m in original.getmembers() if m.isfile()]
    for extra, dropped in ((f"{top}/tests/conftest.py", None), (None, f"{top}/Cargo.lock")):
        changed = tmp_path / "changed" / sdist.name
        changed.parent.mkdir(exist_ok=True)
        with tarfile.open(changed, "w:gz") as out:
            for member, data in members:
                if member.name != dropped:
                    out.addfile(member, io.BytesIO(data))
            if extra is not None:
                info = tarfile.TarInfo(extra)
                info.size = 1
                out.addfile(info, io.BytesIO(b"\n"))
        problems = check_dist.check_sdist(changed)[0]
        if extra is not None:
            assert any("tests/conftest.py: not needed to build" in p for p in problems), problems
        else:
            assert "no Cargo.lock" in problems, problems
