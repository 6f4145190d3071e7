"""The test tree itself: pytest puts tests/ on sys.path, so a test package named like an installed distribution's
module shadows it (transformers found tests/kernels where Hugging Face's `kernels` package was meant, and TRL
failed to import)."""

from __future__ import annotations

from importlib.metadata import packages_distributions
from pathlib import Path


def test_no_test_package_shadows_an_installed_module():
    installed = packages_distributions()
    packages = [p.parent.name for p in Path(__file__).parent.glob("*/__init__.py")]
    shadowing = {name: installed[name] for name in packages if name in installed}
    assert not shadowing, f"test packages named like installed modules (rename them): {shadowing}"
