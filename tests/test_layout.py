"""The folder tree is the process diagram: which package may import which, no import circle, and every
``hpcrl/...`` path that README, docs, benchmarks, tests and docstrings name exists."""

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "hpcrl"
MODULES = sorted(PACKAGE.rglob("*.py"))

# (package, prefixes it must not import, prefixes it may import despite that)
RULES = [
    ("hpcrl.inference", ("hpcrl.rollout", "hpcrl.controller"), ()),
    ("hpcrl.rollout", ("hpcrl.controller",), ()),
    ("hpcrl.train", ("hpcrl.controller", "hpcrl.rollout", "hpcrl.inference"), ("hpcrl.inference.weight_group",)),
    ("hpcrl.launch", ("hpcrl.controller", "hpcrl.rollout", "hpcrl.inference", "hpcrl.train"), ()),
]
# (module, prefix): one module that crosses its package's boundary on purpose. The join command starts a server for a
# running run exactly as the run starts its own (roles.py: argv, environment, Slurm resources)
CROSSINGS = [("hpcrl.inference.join", "hpcrl.controller.roles")]
_PATH = re.compile(r"(?<![\w/.~-])hpcrl/[\w/]*[\w.]*\w/?")  # not /shared/hpcrl/runs: a path on a cluster


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (``from a.b import c`` counts as a.b and a.b.c)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def boundary_violations(modules: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in sorted(modules.items()):
        for package, banned, allowed in RULES:
            if not _under(module, package):
                continue
            for name in sorted(imported):
                crossing = any(module == m and _under(name, prefix) for m, prefix in CROSSINGS)
                if any(_under(name, b) for b in banned) and not any(_under(name, a) for a in allowed) and not crossing:
                    bad.append(f"{module} imports {name}")
    return bad


def test_no_package_imports_across_its_boundary():
    modules = {module_name(p): imports(p) for p in MODULES}
    assert boundary_violations(modules) == []


def test_the_boundary_check_catches_a_wrong_way_import():
    modules = {
        "hpcrl.inference.client": {"hpcrl.rollout.workflows.base"},
        "hpcrl.train.weight_push": {"hpcrl.inference.weight_group", "hpcrl.inference.server.app"},
        "hpcrl.launch.slurm.scripts": {"hpcrl.controller.roles"},
        "hpcrl.rollout.executor": {"hpcrl.inference.client"},
    }
    assert boundary_violations(modules) == [
        "hpcrl.inference.client imports hpcrl.rollout.workflows.base",
        "hpcrl.launch.slurm.scripts imports hpcrl.controller.roles",
        "hpcrl.train.weight_push imports hpcrl.inference.server.app",
    ]


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of module-level imports among the graph's modules, or [] (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt in graph and not state.get(nxt) and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if not state.get(node) and (cycle := visit(node)):
            return cycle
    return []


def test_no_import_circle():
    """Imports inside functions count too: a circle hidden in a function is still two modules that need
    each other (as launch/slurm's scheduler.py and steps.py once did)."""
    names = {module_name(p) for p in MODULES}
    graph = {module_name(p): {n for n in imports(p) if n in names} for p in MODULES}
    for name in list(graph):  # importing a.b.c runs a/__init__ and a/b/__init__ first
        graph[name] = {n for n in graph[name] if n != name and not name.startswith(n + ".")}
    assert import_cycle(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) == []


TEXTS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "bench" / "README.md",
    *MODULES,
    *sorted((REPO / "tests").rglob("*.py")),
    *sorted((REPO / "bench").glob("*.py")),
]


@pytest.mark.parametrize("text", TEXTS, ids=[str(p.relative_to(REPO)) for p in TEXTS])
def test_every_hpcrl_path_named_exists(text: Path):
    if text == Path(__file__):
        return  # the examples below name paths that do not exist on purpose
    missing = [p for p in _PATH.findall(text.read_text()) if not (REPO / p.rstrip(".")).exists()]
    assert missing == [], f"{text.relative_to(REPO)} names paths under hpcrl/ that do not exist: {missing}"


def test_the_path_check_reads_paths_as_written():
    assert _PATH.findall("see `hpcrl/rollout/workflows/` and hpcrl/inference/server/app.py.") == [
        "hpcrl/rollout/workflows/",
        "hpcrl/inference/server/app.py",
    ]


def test_the_path_check_skips_paths_outside_the_repository():
    assert _PATH.findall("/shared/hpcrl/runs and ~/hpcrl/.venv/") == []
