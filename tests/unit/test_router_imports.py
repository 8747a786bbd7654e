"""The router package stands below the cluster: cluster/ may import kvmesh.router, never the reverse
(the simulator drives the same RoutingState and EventLog the cluster runs, without Ray or Serve)."""

import ast
from pathlib import Path

import kvmesh.router

ROUTER = Path(kvmesh.router.__file__).parent


def imported_modules(tree: ast.AST, package: str) -> list[str]:
    """Every module a file imports, relative imports resolved against `package`."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            else:
                names.append(node.module)
    return names


def cluster_imports() -> dict[str, list[str]]:
    found = {}
    for path in sorted(ROUTER.rglob("*.py")):
        package = ".".join(["kvmesh", "router", *path.relative_to(ROUTER).parent.parts])
        tree = ast.parse(path.read_text(), filename=str(path))
        bad = [m for m in imported_modules(tree, package)
               if m == "kvmesh.cluster" or m.startswith("kvmesh.cluster.")]
        if bad:
            found[str(path.relative_to(ROUTER))] = bad
    return found


def test_no_module_under_router_imports_the_cluster():
    assert len(list(ROUTER.rglob("*.py"))) > 20  # the walk found the package
    assert cluster_imports() == {}


def test_the_check_sees_absolute_and_relative_imports_of_the_cluster():
    source = "import kvmesh.cluster.app\nfrom kvmesh.cluster import x\nfrom ...cluster.y import z\n"
    names = imported_modules(ast.parse(source), "kvmesh.router.sim")
    assert names == ["kvmesh.cluster.app", "kvmesh.cluster", "kvmesh.cluster.y"]
