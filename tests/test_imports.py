"""The import graph of the package, read from the source with ast: imports run one way, the
way of the rooms in DESIGN.md (no cycle, not even through an import inside a function or
one under TYPE_CHECKING), the validators are a leaf, models are the maths alone, and only the
registry names the families."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tformer"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(node: ast.AST) -> list[str]:
    """The tformer modules an import statement loads when it runs."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from a.b import c` loads a.b, and a.b.c too when c is a module.
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    found = []
    for name in names:
        if name in MODULES:
            # Importing a.b.c runs the __init__ of a and a.b first.
            parts = name.split(".")
            found += [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
    return [m for m in found if m in MODULES]


def edges(name: str, *, typing: bool = False) -> set[str]:
    """Every tformer module `name` imports, at the top or inside a function; imports under
    `if TYPE_CHECKING:` never run and are left out, unless `typing`."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node) and not typing:
            for child in node.orelse:
                visit(child)
            return
        out.update(imported(node))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out.discard(name)
    # A module's own packages have run their __init__ before it runs: importing a sibling
    # loads the sibling alone.
    parts = name.split(".")
    out.difference_update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


GRAPH = {name: edges(name) for name in MODULES}
"""The imports that run."""
TYPED_GRAPH = {name: edges(name, typing=True) for name in MODULES}
"""...and those a type checker reads too."""


def find_cycle(graph: dict[str, set[str]] = GRAPH) -> list[str] | None:
    """A cycle of imports as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def test_the_graph_is_read_from_real_imports():
    # A check that the parser sees imports at all, including those inside functions.
    assert "tformer.config" in GRAPH["tformer.registry"]
    assert "tformer.kernels.quantize" in GRAPH["tformer.api"]
    assert "tformer.layers" in GRAPH["tformer.models.gpt"]


def test_the_cycle_finder_finds_a_cycle():
    GRAPH["tformer.checks"].add("tformer.config")
    try:
        cycle = find_cycle()
    finally:
        GRAPH["tformer.checks"].discard("tformer.config")
    assert cycle is not None and cycle[0] == cycle[-1] and "tformer.checks" in cycle


def test_imports_have_no_cycle():
    assert find_cycle() is None
    assert find_cycle(TYPED_GRAPH) is None


ROOMS = [
    ("errors", "checks", "config", "arguments"),
    ("kernels", "data"),
    ("layers",),
    ("models",),
    ("decoding",),
    ("evaluation",),
    ("tasks",),
    ("registry",),
    ("loading",),
    ("training",),
    ("api",),
    ("serving", "interop", "viz"),
    ("cli", "tformer"),
    ("__main__",),
]
"""DESIGN.md's order of the rooms, lowest first: a module imports from its own room and from
rooms below it (the leaves, the first row, from one another), never from one above or beside
it. The registry sits above decoding and tasks because a family's entry names its decoders,
its task and its views."""

BELOW_THEIR_ROOM = {
    "tformer.evaluation.loss": 2.5,  # the loss a model's forward may return (Targets)
    "tformer.viz": 0.5,  # `require`, the one-line error for a missing optional package
    "tformer.viz.attention": 6.5,  # views a family's registry entry names
    "tformer.viz.cost": 6.5,
    "tformer.viz.tensorboard": 8.5,  # the writer training logs to
    "tformer.training.distributed": 5.5,  # the process group an XL task's data splits over
    "tformer.training.device": 5.5,
    "tformer.training.lora": 7.5,  # adapters a checkpoint may load with
}
"""Modules that lower rooms use, placed below their package's room (between two rooms)."""


def room_of(module: str) -> float:
    if module in BELOW_THEIR_ROOM:
        return BELOW_THEIR_ROOM[module]
    parts = module.split(".")
    package = parts[1] if len(parts) > 1 else parts[0]
    return next(i for i, room in enumerate(ROOMS) if package in room)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import against the order: into a room above, or beside, the importer's."""
    found = []
    for name, deps in graph.items():
        for dep in deps:
            here, there = room_of(name), room_of(dep)
            same_package = name.split(".")[:2] == dep.split(".")[:2]
            # An empty __init__ runs nothing: importing a.b.c loads it, and no room follows.
            empty = not graph[dep] and MODULES[dep].name == "__init__.py"
            if same_package or empty or there < here or here == there == 0:
                continue
            found.append(f"{name} -> {dep}")
    return sorted(found)


def test_imports_follow_the_order_of_the_rooms():
    assert upward_imports(TYPED_GRAPH) == []


def test_the_order_check_sees_an_import_against_it():
    TYPED_GRAPH["tformer.layers.norm"].add("tformer.decoding.runner")
    try:
        assert upward_imports(TYPED_GRAPH) == ["tformer.layers.norm -> tformer.decoding.runner"]
    finally:
        TYPED_GRAPH["tformer.layers.norm"].discard("tformer.decoding.runner")


def test_models_are_the_maths_alone():
    """A model imports no kernel and no decoding: fast paths wrap models
    (tformer.decoding.runner), they do not live in them."""
    models = [m for m in MODULES if m.startswith("tformer.models")]
    assert len(models) >= 4
    for name in models:
        outside = {dep for dep in TYPED_GRAPH[name]
                   if dep.startswith(("tformer.kernels", "tformer.decoding"))}
        assert not outside, name


def test_the_validators_are_a_leaf():
    assert GRAPH["tformer.checks"] == {"tformer.errors"}
    assert GRAPH["tformer.errors"] == set()


def test_only_the_registry_imports_the_families():
    family_modules = {m for m in MODULES if m.startswith(("tformer.tasks.", "tformer.models."))}
    for name in ("tformer.config", "tformer.training.checkpoint", "tformer.loading",
                 "tformer.training.run", "tformer.api",
                 "tformer.training.trainer", "tformer.decoding.lm"):
        assert not GRAPH[name] & family_modules, name
    importers = {m for m, deps in GRAPH.items() if deps & {"tformer.tasks.gpt",
                                                           "tformer.tasks.seq2seq",
                                                           "tformer.tasks.transformer_xl"}}
    assert importers == {"tformer.registry"}


def test_the_command_line_reaches_the_families_only_through_the_registry():
    family_modules = {m for m in MODULES if m.startswith(("tformer.tasks.", "tformer.models."))}
    cli = [m for m in MODULES if m == "tformer.cli" or m.startswith("tformer.cli.")]
    assert len(cli) > 5
    for name in cli:
        assert not GRAPH[name] & family_modules, name


def test_importing_the_package_and_its_command_line_loads_no_torch():
    """`import tformer` and the `tformer` command's own module stay light: torch loads
    when a command needs it, after Ctrl-C is handled (tformer.cli)."""
    code = "import sys, tformer, tformer.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC)})
    assert out.stdout.strip() == "False"


def reachable(name: str) -> set[str]:
    """Every tformer module that importing `name` runs, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for nxt in GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_config_is_a_leaf():
    assert reachable("tformer.config") <= {"tformer.checks", "tformer.errors"}
    # ...and reading one loads no torch: the families' dataclasses reach it from the registry.
    code = ("import sys, tformer.config; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={"PYTHONPATH": str(SRC)})
    assert loaded.stdout.strip() == "[]"


def test_attention_reads_without_the_kernels():
    """The module's forward is the plain computation: the decoding kernels are the caches'
    business (tformer.layers.cache), and the dropout kernel scaled_dot_product's."""
    kernels = {m for m in MODULES if m.startswith("tformer.kernels")}
    assert not GRAPH["tformer.layers.attention"] & kernels
    assert not GRAPH["tformer.layers.masks"] & kernels
    assert GRAPH["tformer.layers.cache"] & kernels  # (the check can see a kernel import)
