"""Packaging holds together without building anything: every data file in the package ships with the
wheel, the version has one source that setuptools can read without importing qkv, the installed
metadata and the changelog agree with it, and the pre-commit hooks run what CI runs.

.ci/wheel_smoke.sh builds and installs the real wheel; these checks are the fast half.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import qkv

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "qkv"
VERSION = "2.0.0"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _package_data_globs() -> list[str]:
    return _pyproject()["tool"]["setuptools"]["package-data"]["qkv"]


def test_every_package_data_glob_matches_files() -> None:
    for pattern in _package_data_globs():
        files = [p for p in PACKAGE.glob(pattern) if p.is_file()]
        assert files, f"pyproject.toml's package-data glob {pattern!r} matches no file under src/qkv"


def test_recipes_and_static_files_are_package_data() -> None:
    globs = _package_data_globs()
    assert "viz/static/*" in globs and "runs/recipes/*.toml" in globs and "py.typed" in globs, globs


def test_every_data_file_in_the_package_ships() -> None:
    # A file that is not Python code reaches the wheel only through a package-data glob: one added
    # without a glob would be missing from every installed qkv while every test here still passed.
    data_files = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and p.suffix not in {".py", ".pyc"} and "__pycache__" not in p.parts
    }
    shipped = {p.relative_to(PACKAGE).as_posix() for pattern in _package_data_globs() for p in PACKAGE.glob(pattern)}
    assert data_files - shipped == set(), "data files no package-data glob in pyproject.toml ships"


def test_git_ignores_no_file_of_the_package() -> None:
    # A file git ignores is in this checkout but in no clone, so in no wheel CI builds (a pattern such as
    # "runs/" without a leading slash also matches src/qkv/runs/).
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--", "src/qkv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    ignored = [name for name in listed if name and "__pycache__" not in name and not name.endswith(".pyc")]
    assert ignored == [], f"files of src/qkv that .gitignore hides from git: {ignored}"


def test_the_version_has_one_source() -> None:
    project = _pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qkv.__version__"}
    assert qkv.__version__ == VERSION


def test_setuptools_reads_the_version_without_importing_qkv() -> None:
    # setuptools reads `attr:` statically when the module assigns a string literal; anything else makes
    # it import qkv, which needs torch, which a build's isolated environment does not have.
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    literals = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert literals == [qkv.__version__]


def test_installed_metadata_matches_the_code() -> None:
    installed = importlib.metadata.version("qkv")
    assert installed == qkv.__version__, (
        f"the installed metadata says {installed}, the code {qkv.__version__}: reinstall (pip install -e .)"
    )


def test_the_changelog_has_an_entry_for_this_version_first() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]? - (\d{4}-\d{2}-\d{2})$", text, flags=re.MULTILINE)
    assert releases, "CHANGELOG.md has no '## X.Y.Z - YYYY-MM-DD' heading"
    assert releases[0][0] == qkv.__version__, f"the newest entry is {releases[0][0]}, qkv is {qkv.__version__}"
    dates = [date for _, date in releases]
    assert dates == sorted(dates, reverse=True), "CHANGELOG.md's entries are not newest first"


def test_the_changelogs_relative_links_resolve() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"CHANGELOG.md links to {target}, which does not exist"


def test_pre_commit_runs_what_ci_runs() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    entries = [hook["entry"] for repo in config["repos"] for hook in repo["hooks"]]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in ("ruff check", "ruff format --check", "mypy"):
        assert any(entry.startswith(command) for entry in entries), f"no pre-commit hook runs {command}"
        assert re.search(rf"^{re.escape(command)}\b", ci, flags=re.MULTILINE), f".ci/run does not run {command}"
    assert "bash .ci/wheel_smoke.sh" in ci
