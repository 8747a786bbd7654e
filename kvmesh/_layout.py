"""Make `kvmesh.worker` & co. importable from a source checkout.

pyproject.toml maps the top-level folders worker/, kernels/, router/ and cluster/ to
kvmesh.worker, kvmesh.kernels, kvmesh.router and kvmesh.cluster. An installed wheel has them in
place under kvmesh/, but from the repository root the local kvmesh/ folder shadows the installed
package (the current directory comes first on sys.path) and the mapped folders are siblings, not
children. This finder resolves them to the siblings in that case only.
"""

import importlib.abc
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
        init = os.path.join(folder, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[folder])


def install(package_dir: str) -> None:
    """Register the finder when `package_dir` (kvmesh/) sits in a source checkout."""
    if os.path.isdir(os.path.join(package_dir, "worker")):
        return  # installed layout: the subpackages are real children
    root = os.path.dirname(package_dir)
    if not any(isinstance(f, _SiblingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SiblingFinder(root))
