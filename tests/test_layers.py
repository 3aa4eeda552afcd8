"""The package's import rules, read from its source with ``ast`` (issue 24; docs/ARCHITECTURE.md "the layers"):

(a) no import cycle between the package's modules;
(b) no module imports a module of a higher layer (:data:`LAYERS`);
(c) imports of the package's own modules sit at the top of the file, not inside functions, except the few in
    :data:`LAZY_IMPORTS`, each with its reason (optional heavy third-party dependencies may be imported where they
    are used; this test reads only the package's own imports).

Every ``import`` / ``from ... import`` counts, at the top of a file, inside ``if TYPE_CHECKING:`` (an annotation is
an arrow too) or inside a function; ``from deepseek_v41.x import y`` is an import of ``deepseek_v41.x.y`` when
``y`` is a submodule, else of ``deepseek_v41.x``; relative imports are resolved; ``importlib.import_module`` with
a literal name counts as a function-level import.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import deepseek_v41

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "deepseek_v41"

# Bottom to top. A module's layer is the entry whose path prefix is the longest that matches its file (so
# deepseek_v41/kernels/fast/ sits above deepseek_v41/kernels/). A module may import its own layer and those below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # What everything may use: the version, progress lines, dtype names, the config and the Engram table sizes
    # it validates, the chat format, and the C kernels' loader and wrappers (plain tensors in, tensors out).
    ("base", ("deepseek_v41/__init__.py", "deepseek_v41/progress.py", "deepseek_v41/dtypes.py",
              "deepseek_v41/config.py", "deepseek_v41/engram_sizes.py", "deepseek_v41/chat/",
              "deepseek_v41/kernels/", "deepseek_v41/disagg/__init__.py", "deepseek_v41/disagg/config.py")),
    # Number formats (FP8 / FP4 / UE8M0) and the layer plan: functions of the config and of tensors.
    ("numerics", ("deepseek_v41/quant/", "deepseek_v41/plan.py")),
    # The reference model: one module per concept, and its checkpoints.
    # (and the encoder-only prefill model of a kv_producer, which load_model prunes: issue 29)
    ("model", ("deepseek_v41/model/", "deepseek_v41/disagg/encoder_only.py")),
    # What is installed on or built around a loaded model: the fast paths (they install on model classes, so they
    # sit above model/ although they live under kernels/) and the paged KV cache / prefix cache (its attention
    # context calls the fast paths).
    # Tensor / expert parallel sharding (issue 28): parallel layers (subclasses of the model's) and the collectives
    # they call, sharding, sharded loading; the fast backend installs on them (kernels/fast/moe.py).
    ("fast paths and cache", ("deepseek_v41/kernels/fast/", "deepseek_v41/cache/",
                              "deepseek_v41/distributed/__init__.py", "deepseek_v41/distributed/config.py",
                              "deepseek_v41/distributed/comm.py", "deepseek_v41/distributed/layers.py",
                              "deepseek_v41/distributed/shard.py", "deepseek_v41/distributed/loader.py",
                              "deepseek_v41/disagg/connector.py", "deepseek_v41/disagg/ec_connector.py",
                              "deepseek_v41/disagg/nixl_connector.py", "deepseek_v41/disagg/vision_only.py")),
    # Constrained decoding: grammars (xgrammar / llguidance, the DSML tool-call tags) and token bitmasks; the engine
    # masks its logits with them.
    ("structured", ("deepseek_v41/structured/",)),
    # The engine, and the executors that run one over several processes (issue 28): rank 0's DriverEngine is an
    # LLMEngine, ``LLM`` builds it, and the workers run engines (the sharding files above stay in their layer: the
    # longest prefix wins).
    ("engine", ("deepseek_v41/engine/", "deepseek_v41/distributed/")),
    # Accounting from the code (KV bytes, FLOPs, parameters); a model card (train/) uses it.
    ("analysis", ("deepseek_v41/analysis/",)),
    ("train", ("deepseek_v41/train/",)),
    # (and the disaggregated-serving router: an OpenAI front over servers, issue 29)
    ("server", ("deepseek_v41/server/", "deepseek_v41/disagg/router.py")),
    # The command line (dsv41 and its subcommands): the top; nothing imports it.
    ("cli", ("deepseek_v41/cli/",)),
]

# Function-level imports of the package's own modules that stay: (importing file, imported module, or "*" for
# every import of that file) -> why.
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    ("deepseek_v41/__init__.py", "deepseek_v41.engine"):
        "PEP 562 __getattr__ re-exports LLM, SamplingParams...: `import deepseek_v41` imports no torch "
        "(tests/test_package_api.py)",
    ("deepseek_v41/__init__.py", "deepseek_v41.model.checkpoint"):
        "deepseek_v41.load_model, same reason",
    ("deepseek_v41/structured/manager.py", "deepseek_v41.structured.xgrammar_backend"):
        "imports xgrammar (and through it transformers): only an engine that gets a constrained request pays",
    ("deepseek_v41/structured/manager.py", "deepseek_v41.structured.guidance_backend"):
        "imports llguidance: only when xgrammar refuses a constraint",
}

# Other modules (third-party or the standard library) that may be imported inside a function: top-level name -> why
# (optional or heavy, and needed by one path only). Any other import belongs at the top of its file.
DEFERRED: dict[str, str] = {
    "matplotlib": "only `dsv41 report --plot` draws (about 350 ms to import)",
    "PIL": "only image inputs are decoded with it",
    "rich": "progress bars and tables, drawn only on a terminal or on request",
    "tqdm": "LLM's and training's progress bars, only when asked for (use_tqdm)",
    "mlx": "an oracle of the tests, optional", "ray": "optional", "nixl": "optional",
    "xgrammar": "constrained decoding; it imports transformers (seconds): only an engine with a constrained request",
    "llguidance": "constrained decoding's fallback, only for a constraint xgrammar refuses",
}
# The same, for one file: (file, top-level name) -> why.
DEFERRED_IN_FILE: dict[tuple[str, str], str] = {
    ("deepseek_v41/__init__.py", "torch"): "`import deepseek_v41` imports no torch (tests/test_package_api.py)",
}

# Imports of a higher layer that stay: (importing file, imported module) -> why. Each must also be in
# LAZY_IMPORTS (a function-level import cannot form a cycle at import time), and is left out of the cycle check.
UPWARD_IMPORTS: dict[tuple[str, str], str] = {
    ("deepseek_v41/__init__.py", "deepseek_v41.engine"): "the package's public names (see LAZY_IMPORTS)",
    ("deepseek_v41/__init__.py", "deepseek_v41.model.checkpoint"): "the package's public names (see LAZY_IMPORTS)",
}


@dataclass(frozen=True)
class Import:
    """One import statement's arrow: ``source`` file imports ``target`` module at ``line``."""

    source: str  # file path relative to the repository, e.g. deepseek_v41/model/transformer.py
    target: str  # dotted module name, e.g. deepseek_v41.model.checkpoint
    line: int
    in_function: bool

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}" + (" (in a function)" if self.in_function else "")


def _modules() -> dict[str, str]:
    """Dotted module name -> file path (relative to the repository) of every module of the package."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = rel.as_posix()
    return out


MODULES = _modules()
FILES = {path: name for name, path in MODULES.items()}

# The names `deepseek_v41/__init__.py` provides lazily (PEP 562), by the module that holds each: `from deepseek_v41
# import LLM` imports deepseek_v41.engine when it runs, so the reader counts it as that import.
REEXPORTS = {**dict.fromkeys(deepseek_v41._ENGINE_NAMES, "deepseek_v41.engine"),
             "load_model": "deepseek_v41.model.checkpoint"}


def _targets(module: str, path: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules one import statement imports: package modules by their dotted name, any other by its top-level
    name (``torch``, ``json``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES
                 else REEXPORTS.get(alias.name, base) if base == PACKAGE and module != PACKAGE else base
                 for alias in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != PACKAGE:
            name = name.split(".")[0]
        else:
            while name not in MODULES:  # `import deepseek_v41.x.y` of a name that is not a module: its package
                name = name.rpartition(".")[0]
        if name not in out and name != "__future__":
            out.append(name)
    return out


def _imports(path: str, source: str | None = None) -> list[Import]:
    """Every import in one file (``source``: its text, read from ``path`` by default), with whether it runs inside
    a function (see :func:`_targets` for the names)."""
    module = FILES.get(path) or ".".join(Path(path).with_suffix("").parts)
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.extend(Import(path, t, child.lineno, in_function) for t in _targets(module, path, child))
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute | ast.Name)
                  and getattr(child.func, "attr", getattr(child.func, "id", None)) in ("import_module", "__import__")
                  and child.args and isinstance(child.args[0], ast.Constant)
                  and str(child.args[0].value).split(".")[0] == PACKAGE):
                found.append(Import(path, str(child.args[0].value), child.lineno, True))
            visit(child, nested)

    visit(ast.parse(source if source is not None else (ROOT / path).read_text(), filename=path), False)
    return [imp for imp in found if imp.target != module]


ALL_IMPORTS = [imp for path in FILES for imp in _imports(path)]
IMPORTS = [imp for imp in ALL_IMPORTS if imp.target.split(".")[0] == PACKAGE]  # the package's own modules


def layer_of(path: str) -> int:
    """Index in :data:`LAYERS` of the file ``path`` (the longest matching prefix). Raises LookupError for a file
    no entry covers."""
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if path.startswith(prefix) and len(prefix) > len(best):
                best, index = prefix, i
    if index is None:
        raise LookupError(f"{path} is in no layer of LAYERS")
    return index


def _find_cycles(edges: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component of more than one module: ``(its modules, one cycle through them)``, the
    cycle a list of modules of which each imports the next and the last the first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the package's graph is shallow enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    cycles = []
    for component in components:  # the shortest path from the component's first module back to itself
        start = min(component)
        previous: dict[str, str] = {}
        queue = [start]
        while start not in previous:
            v = queue.pop(0)
            for w in sorted(edges[v] & component):
                if w not in previous:
                    previous[w] = v
                    queue.append(w)
        path = [start]
        while previous[path[-1]] != start:
            path.append(previous[path[-1]])
        cycles.append((sorted(component), path[::-1][-1:] + path[::-1][:-1]))
    return cycles


def test_every_module_has_a_layer():
    missing = []
    for path in FILES:
        try:
            layer_of(path)
        except LookupError as exc:
            missing.append(str(exc))
    assert not missing, "add these files to LAYERS in tests/test_layers.py:\n" + "\n".join(missing)
    unused = [prefix for _, prefixes in LAYERS for prefix in prefixes if not any(p.startswith(prefix) for p in FILES)]
    assert not unused, f"LAYERS names paths that hold no module: {unused}"


def test_no_import_cycle():
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for imp in IMPORTS:
        if (imp.source, imp.target) not in UPWARD_IMPORTS:
            edges[FILES[imp.source]].add(imp.target)
    cycles = _find_cycles(edges)
    lines = []
    for component, cycle in cycles:
        lines.append(f"a cycle among {', '.join(MODULES[m] for m in component)}; one of its loops:")
        for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            at = next(imp for imp in IMPORTS if imp.source == MODULES[a] and imp.target == b)
            lines.append(f"  {at}")
    assert not cycles, "\n".join(lines)


def test_no_upward_import():
    upward = []
    for imp in IMPORTS:
        mine, theirs = layer_of(imp.source), layer_of(MODULES[imp.target])
        if theirs > mine and (imp.source, imp.target) not in UPWARD_IMPORTS:
            upward.append(f"{imp}: layer {LAYERS[mine][0]!r} below {LAYERS[theirs][0]!r}")
    assert not upward, "\n".join(upward)


def test_package_imports_at_the_top():
    lazy = [str(imp) for imp in IMPORTS if imp.in_function
            and (imp.source, imp.target) not in LAZY_IMPORTS and (imp.source, "*") not in LAZY_IMPORTS]
    assert not lazy, (f"{len(lazy)} function-level imports of the package's modules (move them to the top of the "
                      "file; a cycle or an upward import that this creates is a design problem to fix):\n"
                      + "\n".join(lazy))


def test_other_imports_at_the_top():
    lazy = [str(imp) for imp in ALL_IMPORTS if imp.in_function and imp.target.split(".")[0] != PACKAGE
            and imp.target not in DEFERRED and (imp.source, imp.target) not in DEFERRED_IN_FILE
            and (imp.source, "*") not in LAZY_IMPORTS]
    assert not lazy, ("function-level imports of modules that are neither optional nor heavy (move them to the top "
                      "of the file, or add the module to DEFERRED with the reason):\n" + "\n".join(lazy))


@pytest.mark.parametrize("table", ["LAZY_IMPORTS", "UPWARD_IMPORTS"])
def test_allow_lists_are_current(table):
    """Every allow-list entry still matches an import (the lists only shrink), and every upward import that stays
    is function-level."""
    entries = globals()[table]
    used = {(imp.source, imp.target) for imp in IMPORTS} | {(imp.source, "*") for imp in IMPORTS if imp.in_function}
    assert not set(entries) - used, f"stale {table} entries: {sorted(set(entries) - used)}"
    if table == "UPWARD_IMPORTS":
        assert set(entries) <= set(LAZY_IMPORTS)
        eager = [str(imp) for imp in IMPORTS if (imp.source, imp.target) in entries and not imp.in_function]
        assert not eager, "upward imports must be function-level: " + "; ".join(eager)


def test_the_reader_sees_every_kind_of_import():
    """The reader itself: top-level, TYPE_CHECKING, function-level, relative and submodule imports."""
    assert {imp.target for imp in _imports("deepseek_v41/__init__.py") if imp.in_function} == {
        "deepseek_v41.engine", "deepseek_v41.model.checkpoint", "torch"}
    source = ("from typing import TYPE_CHECKING\nimport torch\nfrom . import norm\nfrom ..quant import fp8\n"
              "from deepseek_v41.model import rope, MISSING\nimport deepseek_v41.plan\n"
              "if TYPE_CHECKING:\n    from deepseek_v41.config import ModelConfig\n"
              "def f():\n    from deepseek_v41.cache import kv_cache\n"
              "    import importlib\n    return importlib.import_module('deepseek_v41.engine.llm')\n")
    found = {(imp.target, imp.in_function) for imp in _imports("deepseek_v41/model/probe.py", source)}
    assert found == {("deepseek_v41.model.norm", False), ("deepseek_v41.quant.fp8", False),
                     ("deepseek_v41.model.rope", False), ("deepseek_v41.model", False), ("deepseek_v41.plan", False),
                     ("deepseek_v41.config", False), ("deepseek_v41.cache.kv_cache", True),
                     ("deepseek_v41.engine.llm", True), ("typing", False), ("torch", False),
                     ("importlib", True)}
    assert _find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [(["a", "b", "c"], ["a", "b", "c"])]


def test_a_lazily_reexported_name_counts_as_its_module():
    """`from deepseek_v41 import LLM` in model/ is an upward import of the engine (and a cycle at import time),
    not an import of the package's base layer; every public name of the package has its module here."""
    assert set(REEXPORTS) == set(deepseek_v41.__all__)
    found = _imports("deepseek_v41/model/probe.py", "from deepseek_v41 import LLM, load_model, __version__\n")
    assert {imp.target for imp in found} == {"deepseek_v41.engine", "deepseek_v41.model.checkpoint", "deepseek_v41"}
    assert layer_of(MODULES["deepseek_v41.engine"]) > layer_of("deepseek_v41/model/probe.py")
