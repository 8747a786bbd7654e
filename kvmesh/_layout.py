"""Make `kvmesh.worker` & co. importable from a source checkout.

pyproject.toml maps the top-level folders worker/, kernels/, router/ and cluster/ to
kvmesh.worker, kvmesh.kernels, kvmesh.router and kvmesh.cluster. An installed wheel has them in
place under kvmesh/, but from the repository root the local kvmesh/ folder shadows the installed
package (the current directory comes first on sys.path) and the mapped folders are siblings, not
children. This finder resolves them to the siblings in that case only.

worker/, kernels/ and cluster/ have no __init__.py on purpose: from the repository root (Ray's
workers of a `kvmesh serve` started there, `python -m pytest`) a folder with one is importable as a
top-level package and shadows an installed package of that name (transformers 5.25 imports Hugging
Face's `kernels` at model load); a folder without one is at most a namespace portion, which any
installed package of the name outranks. router/ keeps its __init__.py (its API); nothing installed
here is named router (tests/unit/test_packaging.py checks both).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

MAPPED = ("worker", "kernels", "router", "cluster")


class _SiblingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix != "kvmesh" or name not in MAPPED:
            return None
        folder = os.path.join(self.root, name)
        if not os.path.isdir(folder):
            return None
        init = os.path.join(folder, "__init__.py")
        if os.path.isfile(init):
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[folder])
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)  # a namespace package
        spec.submodule_search_locations = [folder]
        return spec


def install(package_dir: str) -> None:
    """Register the finder when `package_dir` (kvmesh/) sits in a source checkout."""
    if os.path.isdir(os.path.join(package_dir, "worker")):
        return  # installed layout: the subpackages are real children
    root = os.path.dirname(package_dir)
    if not any(isinstance(f, _SiblingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SiblingFinder(root))
