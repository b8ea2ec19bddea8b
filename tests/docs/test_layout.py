"""The tests mirror the code (docs/DESIGN.md §2): every test module lives under `tests/<package>/`,
a folder named after a package of the code (`tests/gateway/proxy/` for `gateway.proxy`), or in
`tests/system/` (behaviour of the whole stack) or `tests/docs/`; what modules share is in
`tests/support/` (helpers, which benchmarks import too) or a folder's conftest.py (fixtures).
No test module imports another, and no benchmark imports a test module."""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

from tests.support.servers import REPO

TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"
FOLDERS_OF_THEIR_OWN = {"system", "docs"}  # behaviour suites, the docs' own checks
SUPPORT = "support"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ROOT_PACKAGES = PYPROJECT["tool"]["importlinter"]["root_packages"]
CORE = "claw_pipelines"


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def package_of(parts: tuple[str, ...]) -> Path | None:
    """The code package a test folder's path below tests/ names: its first part a root package
    or a package of claw_pipelines, each further part a subpackage of the one before."""
    first, *rest = parts
    package = REPO / first if first in ROOT_PACKAGES else REPO / CORE / first
    for part in rest:
        package = package / part
    return package if (package / "__init__.py").exists() else None


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file; relative ones as '.'-prefixed."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def is_test_module_import(module: str) -> bool:
    """Whether an import reaches into tests/ other than tests/support (or is relative)."""
    if module.startswith("."):
        return True
    parts = module.split(".")
    return parts[0] == "tests" and (len(parts) < 2 or parts[1] != SUPPORT)


def test_every_test_module_lives_under_a_folder_named_after_a_package_of_the_code():
    misplaced = []
    for path in modules(TESTS):
        parts = path.relative_to(TESTS).parts
        if parts[0] == SUPPORT:
            if path.name.startswith("test_"):
                misplaced.append(f"{path}: a test module in tests/support/")
            continue
        if len(parts) == 1:
            if path.name != "__init__.py":
                misplaced.append(f"{path}: directly in tests/ (tests/<package>/, or support/)")
            continue
        if path.name not in ("__init__.py", "conftest.py") and not path.name.startswith("test_"):
            misplaced.append(f"{path}: a helper beside the tests (it belongs in tests/support/)")
        folder = parts[:-1]
        if folder[0] in FOLDERS_OF_THEIR_OWN:
            continue
        if package_of(folder) is None:
            misplaced.append(f"{path}: tests/{'/'.join(folder)}/ names no package of the code")
    assert not misplaced, "\n".join(misplaced)


def test_every_test_folder_is_a_package_and_pytest_collects_it():
    """Each folder has an __init__.py (module names stay distinct: tests.lake.test_x), and none
    is hidden by `norecursedirs` (pytest's default skips any folder named `build`)."""
    default = ["*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}"]
    hidden = PYPROJECT["tool"]["pytest"]["ini_options"].get("norecursedirs", default)
    problems = []
    for path in modules(TESTS):
        if not path.name.startswith("test_"):
            continue
        for folder in path.relative_to(TESTS).parents:
            if folder == Path("."):
                continue
            if not (TESTS / folder / "__init__.py").exists():
                problems.append(f"tests/{folder}/ has no __init__.py")
            if any(fnmatch.fnmatch(folder.name, pattern) for pattern in hidden):
                problems.append(f"tests/{folder}/ is skipped by norecursedirs {hidden}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_no_test_module_imports_another():
    """Test modules, conftests and the support modules import only tests.support."""
    found = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for path in modules(TESTS)
        for line, module in imported(path)
        if is_test_module_import(module)
    ]
    assert not found, "\n".join(found)


def test_no_benchmark_imports_tests_but_tests_support():
    found = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for path in modules(BENCHMARKS)
        for line, module in imported(path)
        if module.split(".")[0] == "tests" and is_test_module_import(module)
    ]
    assert not found, "\n".join(found)
