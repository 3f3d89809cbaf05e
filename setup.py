"""Namespaced packages from top-level folders: runtime/ imports as shoal.runtime, etc.

The package list is computed so new subpackages need no edit here; everything else is in
pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {
    "shoal": "shoal",
    "shoal.runtime": "runtime",
    "shoal.operator": "operator",
}

packages = []
for name, path in ROOTS.items():
    packages.append(name)
    packages.extend(f"{name}.{sub}" for sub in find_packages(path))

setup(packages=packages, package_dir=ROOTS, include_package_data=True)
