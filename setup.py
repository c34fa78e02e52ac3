"""Package discovery for the one import name `mmrl` (the rest of the metadata is in pyproject.toml).

The top-level folders install under `mmrl` (`verifiers/` as `mmrl.verifiers`, ...), so mmrl
never shadows Hugging Face `datasets` or the `verifiers` library. Every package below each
folder is found here, so a new subpackage can never be left out of a wheel.
"""

from setuptools import find_packages, setup

ROOTS = {
    "mmrl": "mmrl",
    "mmrl.verifiers": "verifiers",
    "mmrl.rewards": "rewards",
    "mmrl.datasets": "datasets",
    "mmrl.configs": "configs",
}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]
# Subpackages of `mmrl` itself that the other roots map (`mmrl.verifiers`, ...) are not in mmrl/.
package_dir = {name: folder for name, folder in ROOTS.items()}

setup(packages=sorted(set(packages)), package_dir=package_dir)
