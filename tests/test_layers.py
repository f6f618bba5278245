"""The package's shape: no module of rvqspec/ imports another that (transitively) imports it back, and each package
imports only the layers below it (the direction rule), counting the imports inside functions (which only hide a
cycle or a wrong-way import, they do not cut it)."""

import ast
from pathlib import Path

import rvqspec

PACKAGE = Path(rvqspec.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the rvqspec modules it imports anywhere in its body (`from rvqspec.x import y` counts x, and
    x.y where y is a module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rvqspec":
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "rvqspec"}
        graph[name] = (found & set(modules)) - {name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_module_imports_another_in_a_cycle():
    graph = {name: deps - {"rvqspec"} for name, deps in imports().items() if name != "rvqspec"}
    assert len(graph) > 30
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_a_planted_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


# Which packages each package may import (itself included). The top-level `rvqspec` (its __init__: the public API)
# is left out, as in the cycle rule.
ALLOWED = {
    "core": {"core"},
    "integrations": {"core", "integrations"},
    "tuning": {"core", "integrations", "tuning"},
    "bench": {"core", "integrations", "tuning", "bench"},
    "standin": {"core", "integrations", "tuning", "standin"},
    "runtime": {"core", "integrations", "tuning", "standin", "runtime"},
    "serve": {"core", "runtime", "serve"},
    "cli": {"core", "integrations", "tuning", "bench", "standin", "runtime", "serve", "cli"},
}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rvqspec"


def wrong_way_imports(graph: dict[str, set[str]]) -> list[str]:
    """'importer -> imported' for every import that the direction rule forbids."""
    found = []
    for name, deps in sorted(graph.items()):
        here = package_of(name)
        if here == "rvqspec":
            continue
        for dep in sorted(deps):
            if package_of(dep) not in ALLOWED[here]:
                found.append(f"{name} -> {dep}")
    return found


def test_each_package_imports_only_the_layers_below_it():
    graph = {name: deps - {"rvqspec"} for name, deps in imports().items()}
    assert {package_of(name) for name in graph} == set(ALLOWED) | {"rvqspec"}
    assert wrong_way_imports(graph) == []


def test_the_direction_rule_names_a_planted_violation():
    graph = {"rvqspec.core.model": {"rvqspec.bench.timing"}, "rvqspec.cli.main": {"rvqspec.core.model"},
             "rvqspec.tuning.train": {"rvqspec.cli.flags"}}
    assert wrong_way_imports(graph) == ["rvqspec.core.model -> rvqspec.bench.timing",
                                        "rvqspec.tuning.train -> rvqspec.cli.flags"]


def test_only_the_package_init_stays_at_the_top():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py"]


def test_the_frame_loop_toolkit_keeps_its_old_names_for_a_release():
    from rvqspec.core import frame_loop
    from rvqspec.integrations import base, stream

    for old, names in ((base, ["Stats", "check_arguments"]),
                       (stream, ["POLL_SECONDS", "CHUNK_FRAMES", "MAX_CHUNK_FRAMES", "ChunkClock", "check_chunks"])):
        assert all(getattr(old, name) is getattr(frame_loop, name) for name in names)


# The serving layers read as short steps (issue 43): no function of theirs over this many lines, from its `def` to its
# last line.
MAX_FUNCTION_LINES = 40
SHORT_FUNCTION_PACKAGES = ("runtime", "serve")


def long_functions(source: str, limit: int) -> list[str]:
    """'name: N lines' for each function of `source` (nested ones too, on their own) longer than `limit` lines."""
    return [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit]


def test_no_function_of_runtime_or_serve_is_over_40_lines():
    paths = [path for package in SHORT_FUNCTION_PACKAGES for path in sorted((PACKAGE / package).rglob("*.py"))]
    assert len(paths) > 15
    found = [f"{module_name(path)}.{name}" for path in paths
             for name in long_functions(path.read_text(), MAX_FUNCTION_LINES)]
    assert found == []


def test_the_length_rule_names_a_planted_long_function():
    source = "def short():\n    pass\n\n\n@decorated\nasync def long(x):\n" + "    x += 1\n" * 40
    assert long_functions(source, 40) == ["long: 41 lines"]
    assert long_functions(source, 41) == []
