"""Map each code folder onto ``epdserve.<folder>`` and list every sub-package.

The folders have no ``__init__.py`` at their root (so ``operator/`` never shadows the
stdlib module); ``find_namespace_packages`` therefore discovers their sub-packages, so none
is silently left out of the wheel. The top package ``epdserve`` is the repository root's
``__init__.py`` (lazy public exports) and nothing else from the root.
"""

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

CODE_FOLDERS = ("common", "engine", "connectors", "kernels", "router", "operator")


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package == "epdserve":  # the root holds setup.py too: ship only __init__
            modules = [m for m in modules if m[1] == "__init__"]
        return modules


packages = ["epdserve"]
package_dir = {"epdserve": "."}
for folder in CODE_FOLDERS:
    packages.append(f"epdserve.{folder}")
    package_dir[f"epdserve.{folder}"] = folder
    for sub in find_namespace_packages(where=folder, exclude=("__pycache__", "*.__pycache__")):
        packages.append(f"epdserve.{folder}.{sub}")

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "epdserve.engine": ["**/*.jinja"],
        "epdserve.operator": ["**/*.yaml"],
        "epdserve.kernels": ["csrc/*.c", "csrc/*.h"],
    },
    cmdclass={"build_py": BuildPy},
)
