"""Every integration module whose test bodies (not only its fixtures) start Ray is marked
`starts_ray`, so that under pytest-xdist it holds the Ray start lock (tests/ray_start_lock.py).
What counts as starting Ray in a test body: building a LocalCluster or a config_cluster, an AWS-like
`ray start` head, running `kvmesh serve` or `kvmesh bench ... --launch`, or a driver script that
calls launcher.start_ray, in the test or in a helper function of its module that it calls."""

import ast
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
STARTERS = {"LocalCluster", "config_cluster", "aws_ray_head"}


def _starts_ray(func: ast.FunctionDef, module_strings: dict[str, str], helpers=frozenset()) -> bool:
    """`helpers`: the module's own functions that start Ray (a test that calls one does)."""
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in STARTERS or name in helpers:
                return True
        if isinstance(node, ast.List):  # a command line
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if ("kvmesh.cli" in words and "serve" in words) or any(w.startswith("--launch") for w in words):
                return True
        if isinstance(node, ast.Name) and "start_ray(" in module_strings.get(node.id, ""):
            return True  # a driver script run by the test
    return False


def _marked(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            return "starts_ray" in ast.unparse(node.value)
    return False


def test_modules_whose_tests_start_ray_are_marked():
    unmarked, marked_and_starting = [], 0
    for path in sorted(INTEGRATION.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        strings = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                   for t in node.targets if isinstance(t, ast.Name)
                   and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        fixtures = {f.name for f in functions if any("fixture" in ast.unparse(d) for d in f.decorator_list)}
        helpers = frozenset(f.name for f in functions if not f.name.startswith("test_")
                            and f.name not in fixtures and _starts_ray(f, strings))
        tests = [f for f in functions if f.name.startswith("test_")]
        starting = [t.name for t in tests if _starts_ray(t, strings, helpers)]
        if starting and not _marked(tree):
            unmarked.append(f"{path.name}: {starting}")
        marked_and_starting += bool(starting)
    assert not unmarked, f"mark these modules pytest.mark.starts_ray: {unmarked}"
    assert marked_and_starting >= 6  # the scan finds the known ones (not vacuous)
