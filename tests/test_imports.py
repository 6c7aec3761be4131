"""The imports as the README draws them: fa_torch and fa_jax each on fa_kernels, neither
on the other, fa_kernels on neither framework (checked on the source, every import
statement, lazy ones inside functions included)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"fa_kernels": ROOT / "kernels" / "fa_kernels", "fa_torch": ROOT / "fa_torch",
            "fa_jax": ROOT / "fa_jax"}
FORBIDDEN = {"fa_kernels": {"torch", "jax", "jaxlib", "jax_triton", "fa_torch", "fa_jax"},
             "fa_torch": {"jax", "jaxlib", "jax_triton", "fa_jax"},
             "fa_jax": {"torch", "fa_torch"}}


def imported_modules(package: pathlib.Path) -> dict[str, set[str]]:
    """Top-level names of every absolute import in a package's files, by file."""
    found = {}
    for path in sorted(package.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
        found[path.name] = names
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_drawing(package):
    by_file = imported_modules(PACKAGES[package])
    assert by_file, f"no sources found for {package}"
    wrong = {name: sorted(names & FORBIDDEN[package]) for name, names in by_file.items()
             if names & FORBIDDEN[package]}
    assert not wrong, f"{package} imports what it must not: {wrong}"
    if package != "fa_kernels":
        assert any("fa_kernels" in names for names in by_file.values())
