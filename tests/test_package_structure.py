"""The package's shape, read from its source with `ast` (nothing is imported or run):

- layers that only point down: the package's parts (its subpackages and top-level modules) are
  ranked in LAYERS, and a module may import only from its own part or from a part ranked below
  it; so there is no cycle between parts either;
- no import cycles between modules: every `import` counts, at module level or inside a function (a
  lazy import hides a cycle from the interpreter, not from the reader who has to know which module
  comes first);
- benchmarks live in one subpackage, normswap/benchmarks/ (so `normswap bench ...` runs from an installed
  wheel); the CLI's `bench` module only parses options and calls them, and nothing loads code by file path;
- product code reads no test hooks from the environment: the only NORMSWAP_* names it mentions are
  the documented user settings listed below.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "normswap"

# NORMSWAP_* environment variables product code may read, each a documented user setting.
USER_SETTINGS = {
    "NORMSWAP_KERNEL": "forces one RMSNorm implementation (auto|triton|cpu|native|composite|torch|compiled)",
    "NORMSWAP_AUTOTUNE": "0 uses the static implementation order instead of measuring on first use",
    "NORMSWAP_CACHE_DIR": "where the compiled CPU kernel and the autotune table are cached",
    "NORMSWAP_CPU_KERNEL": "0 never builds or uses the compiled CPU kernel",
    "NORMSWAP_DEBUG": "1 is --debug (tracebacks); --debug sets it so lm-eval's worker code sees it too",
}

# The parts of the package, lowest first: each may import only from itself and the parts before
# it. docs/architecture.md draws the same order. A new subpackage or top-level module takes its
# place here (the test refuses a part it cannot rank).
LAYERS = [
    "errors",  # NormswapError and first_line: everything may fail with one line
    "version",
    "bounded_load",  # YAML and JSON from users: regular files only, size, nesting and alias bounds
    "dir_links",  # the link rule for directories someone else filled (a --data corpus, a saved dataset)
    "private_dirs",  # cache and lock directories no other user can write
    "compile_cache",  # every torch.compile, with Inductor's and Triton's caches in a private directory
    "network",  # the offline rule and the Hub reachability check
    "progress",  # progress lines at a steady interval for every long command
    "processes",  # every process normswap starts ends with the command (signals reach every worker)
    "host",  # the machine's load average and the CPUs this process may use, read one way
    "stats",  # intervals, bootstraps, equivalence, power, Holm, sign-flip and the verdict rules
    "timing",  # the one speed instrument: interleaved pairs, paired ratios, a null control
    "declared",  # options declared once as dataclass fields
    "devices",  # --device / --dtype auto, resolved once
    "kernels",  # the RMSNorm kernels
    "modules",  # normswap.modules.RMSNorm, the nn.Module converted models hold
    "model_facts",  # norms, ε, layouts, context length: read the same way by every stage
    "data",  # corpora, splits, packing
    "assets",  # shipped models and lm-eval tasks (the task code reads data/)
    "overlap",  # what a command reads against what it writes (names normswap:NAME models)
    "public_paths",  # no local directory's path in a published file (the publisher scrubs them)
    "publish",  # atomic outputs and output locks
    "checkpoint",  # loading and writing models and normswap checkpoints
    "architectures",  # family files, discovery by tracing a tiny instance
    "convert",  # plan, execute, verify; checks discovered families by converting
    "slice",  # rotate the residual stream of an exact conversion onto its principal directions, delete the rest
    "export",  # a checkpoint in another format (stock transformers, ONNX), verified before it is published
    "compat",  # the compatibility matrix: every entry point on an original and its conversion
    "finetune",  # healing
    "evaluate",  # measurements of every model, fine-tuned ones included
    "report",  # results.json -> markdown, HTML, plots
    "study",  # a controlled training study of LayerNorm against RMSNorm arms
    "recipes",  # one file driving convert, finetune, eval and report
    "benchmarks",  # what `normswap bench` runs: kernels, decode, ONNX, conversion, timed with `timing`
    "cli",  # one file per command
    "__main__",  # python -m normswap
    "normswap",  # the package's own __init__: the public load_model / load_tokenizer
    "testing",  # the one interface tests reach into normswap through; nothing in the package uses it
]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# -- the import graph -----------------------------------------------------------------------------


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, source: str, modules: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in ``source``.

    ``from P import X`` is an edge to ``P.X`` when that is a module, else to ``P``. The implicit
    import of a module's parent packages is not an edge (Python initialises a package before its
    submodules, so ``P/__init__.py`` importing ``P.sub`` is not a cycle by itself).
    """
    top = next(iter(modules)).split(".")[0] if modules else ""
    package = name if _is_package(name, modules) else name.rpartition(".")[0]

    def known(dotted):
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(known(a.name) for a in node.names if a.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != top:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else known(target))
    out.discard(None)
    out.discard(name)
    return out


def _is_package(name, modules):
    return any(m.startswith(name + ".") for m in modules)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = module_files(package)
    names = set(files)
    return {
        name: imports_of(name, text, names) | {m for m, _ in string_imports(text, names) if m in names}
        for name, path in files.items()
        for text in [path.read_text(encoding="utf-8")]
    }


def string_imports(source: str, modules: set[str]) -> list[tuple[str, str | None]]:
    """Imports written as strings, as (module, attribute or None), for the package's modules.

    Two forms: a ``"pkg.mod:attr"`` string (cli/main.py's COMMANDS), and ``import_module(f"pkg.{x}")``
    whose variable part comes from a dict literal of the same module (finetune/__init__.py's lazy
    map: key = attribute, value = the module it lives in). A string naming a module that does not
    exist is returned as it is, so that the caller can refuse it."""
    top = next(iter(modules)).split(".")[0] if modules else ""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = re.fullmatch(rf"({top}(?:\.\w+)+):(\w+)", node.value)
            if m:
                out.append((m.group(1), m.group(2)))
    prefixes = [
        node.args[0].values[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.JoinedStr)
        and isinstance(node.args[0].values[0], ast.Constant)
        and node.args[0].values[0].value.startswith(top + ".")
    ]
    for prefix in prefixes:
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        attr = key.value if isinstance(key, ast.Constant) else None
                        out.append((prefix + value.value, attr))
    return out


def defines(path: Path, attr: str) -> bool:
    """Whether the module at ``path`` binds ``attr`` at top level (def, class, assignment, import)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return True
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == attr for t in node.targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == attr for a in node.names):
            return True
    return False


def broken_string_imports(package: Path = PACKAGE) -> list[str]:
    files = module_files(package)
    bad = []
    for name, path in files.items():
        for module, attr in string_imports(path.read_text(encoding="utf-8"), set(files)):
            if module not in files:
                bad.append(f"{name}: no module {module}")
            elif attr is not None and not defines(files[module], attr):
                bad.append(f"{name}: {module} has no {attr}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative),
    each as one concrete cycle through its members, e.g. ['a', 'b', 'a']."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(_cycle_through(sorted(component), graph))
    return found


def _cycle_through(component, graph):
    """A shortest path from the component's first member back to itself (breadth-first)."""
    members, first = set(component), component[0]
    parents, frontier = {first: None}, [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == first:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return path[::-1] + [first]
                if child in members and child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return component  # pragma: no cover - a strongly connected component always has a cycle


def test_cycle_finder_detects_cycles_in_a_synthetic_graph():
    # negative control: the finder must see a cycle, including one closed only by a lazy import
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": set()}
    assert cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]
    assert cycles({"p.a": {"p.b"}, "p.b": set(), "p.c": {"p.a", "p.b"}}) == []

    modules = {"p", "p.a", "p.b"}
    lazy = "import os\n\ndef f():\n    from p.b import thing\n    from . import b\n"
    assert imports_of("p.a", lazy, modules) == {"p.b"}
    assert imports_of("p.b", "from p import a\n", modules) == {"p.a"}
    assert imports_of("p", "def f():\n    from p.a import x\n", modules) == {"p.a"}
    assert cycles({"p.a": {"p.b"}, "p.b": {"p.a"}}) == [["p.a", "p.b", "p.a"]]


def part_of(module: str) -> str:
    """The part a module belongs to: ``normswap.convert.plan`` -> ``convert``; the root package's own
    ``__init__`` is the part named like the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between parts (an edge when any module of one imports any module of the other)."""
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        out.setdefault(part_of(name), set()).update(part_of(t) for t in targets if part_of(t) != part_of(name))
    return out


def back_up_imports(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    """Every import from a part to a part ranked above it (or to or from a part ``layers`` does not rank)."""
    rank = {part: i for i, part in enumerate(layers)}
    found = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = part_of(name), part_of(target)
            if low == high:
                continue
            if low not in rank or high not in rank:
                unranked = low if low not in rank else high
                found.append(f"{name} -> {target} ({unranked} has no place in LAYERS)")
            elif rank[low] < rank[high]:
                found.append(f"{name} -> {target} ({low} sits below {high})")
    return found


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_layer_check_flags_a_planted_back_up_import_and_part_cycle(tmp_path):
    # negative control: a real module tree on disk in which `low` imports `high` inside a function
    # (the cycle between parts is closed only by that lazy import), and one module no layer ranks
    files = {
        "pkg/__init__.py": "",
        "pkg/errors.py": "class E(Exception):\n    pass\n",
        "pkg/low/__init__.py": "from pkg.errors import E\n",
        "pkg/low/a.py": "from pkg.errors import E\n\ndef f():\n    from pkg.high.b import g\n    return g()\n",
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from pkg.low import a\n\ndef g():\n    return a\n",
        "pkg/stray.py": "from pkg import errors\n",
    }
    layers = ["errors", "low", "high", "pkg"]
    graph = import_graph(_write_tree(tmp_path / "bad", files))
    assert back_up_imports(graph, layers) == [
        "pkg.low.a -> pkg.high.b (low sits below high)",
        "pkg.stray -> pkg.errors (stray has no place in LAYERS)",
    ]
    assert cycles(part_graph(graph)) == [["high", "low", "high"]]
    assert cycles(graph) == [["pkg.high.b", "pkg.low.a", "pkg.high.b"]]

    # and the same tree with the import pointing down passes
    files["pkg/low/a.py"] = "from pkg.errors import E\n"
    del files["pkg/stray.py"]
    graph = import_graph(_write_tree(tmp_path / "good", files))
    assert back_up_imports(graph, layers) == [] and cycles(part_graph(graph)) == []


def test_layers_only_point_down():
    graph = import_graph()
    found = back_up_imports(graph, LAYERS)
    assert not found, "imports that run back up the layers (imports inside functions count):\n" + "\n".join(found)
    assert set(part_graph(graph)) <= set(LAYERS)
    stale = [p for p in LAYERS if p not in part_graph(graph)]
    assert not stale, f"LAYERS ranks parts the package no longer has: {stale}"


def test_no_import_cycles_between_parts():
    found = cycles(part_graph(import_graph()))
    assert not found, "cycles between the package's parts:\n" + "\n".join(" -> ".join(c) for c in found)


def test_graph_sees_the_package_edges():
    graph = import_graph()
    assert len(graph) > 50
    assert "normswap.errors" in graph["normswap.convert.inplace"]  # a module-level import
    assert "normswap.checkpoint.load" in graph["normswap"]  # a lazy import inside load_model()


def test_package_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(" -> ".join(c) for c in found)


# -- benchmarks in one subpackage ------------------------------------------------------------------

_TIMERS = {"perf_counter", "perf_counter_ns", "synchronize", "Event"}


def benchmark_strays(modules: dict[str, str]) -> list[str]:
    """Benchmark code outside ``normswap.benchmarks``: a module named like a benchmark elsewhere (the CLI's
    entry points excepted), a CLI entry point that times something itself, and any module that loads a
    script from the checkout's bench/ by file path (an installed wheel has no bench/; the compiled CPU
    kernel, loaded from its private cache by path, is not a script)."""
    found = []
    for name, source in sorted(modules.items()):
        tree = ast.parse(source)
        inside = name == "normswap.benchmarks" or name.startswith("normswap.benchmarks.")
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if "spec_from_file_location" in attrs and "bench" in strings:
            found.append(f"{name} loads a script from bench/ by file path")
        if inside or "bench" not in name.rpartition(".")[2]:
            continue
        if not name.startswith("normswap.cli."):
            found.append(f"{name} is a benchmark outside normswap/benchmarks/")
            continue
        imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names} | {
            n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }
        if attrs & _TIMERS or {"time", "timeit"} & imported:
            found.append(f"{name} times something itself (the CLI only parses options and calls normswap.benchmarks)")
    return found


def test_benchmark_check_flags_planted_strays():
    # negative control: a benchmark beside the measurements, a CLI entry point with a clock, and a command
    # that loads bench/<script>.py from the checkout (what `normswap bench` did before) are each found
    modules = {
        "normswap.evaluate.speed_bench": "x = 1\n",
        "normswap.cli.bench_command": "import time\nt = time.perf_counter()\n",
        "normswap.cli.run_command": (
            "import importlib.util\nfrom pathlib import Path\n"
            "p = Path(__file__).parents[2] / 'bench' / 'x.py'\nspec = importlib.util.spec_from_file_location('b', p)\n"
        ),
        "normswap.kernels.cpu": "import importlib.util\nspec = importlib.util.spec_from_file_location('e', so)\n",
        "normswap.benchmarks.decode": "import time\nt = time.perf_counter()\n",
    }
    assert benchmark_strays(modules) == [
        "normswap.cli.bench_command times something itself (the CLI only parses options and calls normswap.benchmarks)",
        "normswap.cli.run_command loads a script from bench/ by file path",
        "normswap.evaluate.speed_bench is a benchmark outside normswap/benchmarks/",
    ]


def test_benchmarks_live_in_one_subpackage():
    files = module_files()
    found = benchmark_strays({name: path.read_text(encoding="utf-8") for name, path in files.items()})
    assert not found, "benchmark code outside normswap/benchmarks/:\n" + "\n".join(found)
    shipped = {name.rpartition(".")[2] for name in files if name.startswith("normswap.benchmarks.")}
    assert {"norm_kernels", "decode", "onnx_runtime", "conversion"} <= shipped, shipped
    assert "normswap.cli.bench_command" in files  # the scan reads the real package's entry point


# -- no test hooks in the environment ------------------------------------------------------------

_NAME = re.compile(r"NORMSWAP_[A-Z0-9_]+")


def env_names(source: str) -> set[str]:
    """NORMSWAP_* names that appear as a whole string constant (how os.environ, getenv and
    `name in os.environ` spell them)."""
    return {
        n.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and _NAME.fullmatch(n.value)
    }


def test_env_scan_finds_a_hook():
    # negative control: a hook read any of the usual ways is found
    hook = (
        'import os\nA = os.environ.get("NORMSWAP_FINETUNE_INJECT_NAN_AT")\n'
        'B = os.getenv("NORMSWAP_X")\nC = "NORMSWAP_Y" in os.environ\nD = os.environ["NORMSWAP_Z"]\n'
    )
    assert env_names(hook) == {"NORMSWAP_FINETUNE_INJECT_NAN_AT", "NORMSWAP_X", "NORMSWAP_Y", "NORMSWAP_Z"}
    assert env_names('"""Set NORMSWAP_KERNEL=torch to force the reference."""\n') == set()


def test_product_reads_only_documented_user_settings():
    used = {}
    for name, path in module_files().items():
        for var in env_names(path.read_text(encoding="utf-8")):
            used.setdefault(var, []).append(name)
    hooks = {var: where for var, where in used.items() if var not in USER_SETTINGS}
    assert not hooks, f"environment variables read by product code that are not user settings: {hooks}"
    docs = "\n".join(p.read_text(encoding="utf-8") for p in DOCS)
    undocumented = [var for var in USER_SETTINGS if var not in docs]
    assert not undocumented, f"user settings not described in README.md, bench/README.md or docs/: {undocumented}"
    assert "NORMSWAP_KERNEL" in used  # the scan reads the real package


@pytest.mark.parametrize("helper", ["test_utils", "fixtures", "test_helpers"])
def test_no_test_helpers_ship(helper):
    assert not (PACKAGE / f"{helper}.py").exists(), f"normswap/{helper}.py ships only for tests; keep it in tests/"


def test_the_testing_interface_is_documented_and_used():
    """normswap/testing.py is the one way into the product's hooks: documented in
    docs/architecture.md, used by the tests, imported by nothing in the package (LAYERS ranks it last)."""
    assert LAYERS[-1] == "testing"
    tree = ast.parse((PACKAGE / "testing.py").read_text(encoding="utf-8"))
    exported = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    names = {e.value for e in exported.elts}
    docs = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "normswap/testing.py" in docs and all(n in docs for n in names), names
    tests = "\n".join(
        p.read_text(encoding="utf-8") for p in (ROOT / "tests").glob("test_*.py") if p.name != Path(__file__).name
    )
    unused = [n for n in names if n not in tests]
    assert not unused, f"hooks in normswap.testing no test uses: {unused}"
    # and the hooks it replaces are not reached for around it
    instead = {
        "_set_isa": "cpu_isa",
        "trainer.Hooks": "FinetuneHooks",
        "autotune.forget()": "forget_kernel_choices()",
        'setenv("NORMSWAP_KERNEL"': "kernel_backend (NORMSWAP_KERNEL is read once per process)",
    }
    for old, new in instead.items():
        assert old not in tests.replace('monkeypatch.setenv("NORMSWAP_KERNEL", "composite")', ""), (
            f"{old}: use normswap.testing.{new}"
        )


# -- each shared fact written once ---------------------------------------------------------------

# Facts several stages need, each with its one home: a function of the same name (or its private
# twin) defined anywhere else is the fact written a second time.
FACTS = {
    "first_line": "normswap.errors",
    "offline_env": "normswap.network",
    "resolve_device": "normswap.devices",
    "resolve_dtype": "normswap.devices",
    "norm_kind": "normswap.model_facts",
    "is_norm": "normswap.model_facts",
    "is_layernorm": "normswap.model_facts",
    "is_rmsnorm": "normswap.model_facts",
    "norm_modules": "normswap.model_facts",
    "declared_eps": "normswap.model_facts",
    "layout_of": "normswap.model_facts",
    "context_length": "normswap.model_facts",
    "model_context": None,  # the old name of context_length: gone
    "probe_inputs": "normswap.architectures.probes",
}


def fact_definitions(modules: dict[str, str]) -> list[str]:
    """Definitions of a FACTS name (or of ``_name``) outside its home, e.g. ``normswap.x defines _first_line``."""
    found = []
    for name, source in sorted(modules.items()):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.lstrip("_") in FACTS:
                if FACTS[node.name.lstrip("_")] != name:
                    found.append(
                        f"{name} defines {node.name} (its home: {FACTS[node.name.lstrip('_')] or 'none, renamed'})"
                    )
    return found


def test_fact_check_flags_a_second_definition():
    # negative control: a private twin of first_line and a second probe_inputs are found; the homes are not
    modules = {
        "normswap.errors": "def first_line(e):\n    return str(e)\n",
        "normswap.data.sources": "def _first_line(e):\n    return str(e).splitlines()[0]\n",
        "normswap.convert.verify": "class A:\n    def probe_inputs(self):\n        pass\n",
        "normswap.architectures.probes": "def probe_inputs(model):\n    pass\n",
    }
    assert fact_definitions(modules) == [
        "normswap.convert.verify defines probe_inputs (its home: normswap.architectures.probes)",
        "normswap.data.sources defines _first_line (its home: normswap.errors)",
    ]


def test_each_shared_fact_is_defined_once():
    found = fact_definitions({name: path.read_text(encoding="utf-8") for name, path in module_files().items()})
    assert not found, "a shared fact written again (import it from its home):\n" + "\n".join(found)


# -- private names stay in their module ----------------------------------------------------------


def private_uses(name: str, source: str, modules: set[str]) -> list[str]:
    """Another module's private names (``_x``) that module ``name`` imports or reads as an attribute
    of an imported module. A private module (``kernels._ops``) is private to its package."""
    top = name.split(".")[0]
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found, aliases = [], {}

    def private(part):
        return part.startswith("_") and not part.startswith("__")

    def foreign(module):  # a private module outside the importer's own package
        parts = module.split(".")
        for i, part in enumerate(parts):
            home = ".".join(parts[:i])
            if private(part) and not (name == home or name.startswith(home + ".")):
                return True
        return False

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                target = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([node.module] if node.module else [])
                )
            if target.split(".")[0] != top:
                continue
            for a in node.names:
                full = f"{target}.{a.name}"
                aliases[a.asname or a.name] = full
                if private(a.name) and full not in modules and target != name:
                    found.append(f"{name} imports {full}")
                elif foreign(full):
                    found.append(f"{name} imports {full}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == top:
                    aliases[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module in modules and module != name:
                found.append(f"{name} reads {module}.{node.attr}")
    return sorted(set(found))


def test_private_name_check_flags_planted_uses():
    # negative control: each way of reaching into another module is seen; a module's own and its
    # package's private module are not
    modules = {"p", "p.a", "p.b", "p.k", "p.k._impl", "p.k.api"}
    bad = "from p.a import _helper\nfrom p import b\nx = b._cache\nfrom p.k import _impl\n"
    assert private_uses("p.c", bad, modules | {"p.c"}) == [
        "p.c imports p.a._helper",
        "p.c imports p.k._impl",
        "p.c reads p.b._cache",
    ]
    fine = "from p.k import _impl\ndef _own():\n    return _impl._x\n"
    assert private_uses("p.k.api", fine, modules) == ["p.k.api reads p.k._impl._x"]
    assert private_uses("p.k.api", "from p.k import _impl\nfrom p.a import helper\n", modules) == []


def test_no_module_uses_another_modules_private_names():
    files = module_files()
    found = [
        u for name, path in files.items() for u in private_uses(name, path.read_text(encoding="utf-8"), set(files))
    ]
    assert not found, "private names used outside their module (make them public or keep them home):\n" + "\n".join(
        found
    )


# -- comments that stay true ----------------------------------------------------------------------

# A comment or docstring says why the code is as it is; history (issue numbers, run folders under
# results/, paths outside the repository) belongs in docs/ and results/, where it stays true.
_HISTORY = re.compile(r"#[0-9]{2}\b|\.\./shared|issue [0-9]|issue #[0-9]|bench/results/\S")


def history_in_comments(source: str) -> list[str]:
    """Comments and docstrings of ``source`` that cite history, as 'line N: text'."""
    import io
    import tokenize

    texts = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            texts.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                texts.append((node.body[0].lineno, doc))
    return [f"line {line}: {m.group(0)!r}" for line, text in sorted(texts) for m in _HISTORY.finditer(text)]


def test_history_check_flags_planted_comments():
    # control: each planted comment or docstring must be found; the help string is code, not a comment
    planted = (
        '"""Module doc (issue #39)."""\n'
        "x = 1  # see #45\n"
        "def f():\n"
        '    """measured in bench/results/onnx-20261203T095207Z"""\n'
        "# ../shared/reference/probes/noise2.py\n"
        'HELP = "e.g. bench/results/convert-1.4b"\n'
    )
    found = history_in_comments(planted)
    assert len(found) == 4, found
    assert history_in_comments('"""Why: a run reads back what it wrote."""\n# 2-5 % slower\n') == []


def test_package_comments_cite_no_history():
    found = [
        f"{path.relative_to(ROOT)} {hit}"
        for path in module_files().values()
        for hit in history_in_comments(path.read_text(encoding="utf-8"))
    ]
    assert not found, f"comments or docstrings that cite history instead of saying why: {found}"


# -- imports written as strings -------------------------------------------------------------------


def test_string_imports_are_resolved_and_checked(tmp_path):
    # control: a planted COMMANDS entry and lazy map naming a missing module, a missing attribute, and
    # a string import that points back up must each be found
    pkg = _write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/errors.py": 'COMMANDS = {"a": "pkg.cli:run", "b": "pkg.gone:run", "c": "pkg.cli:missing"}\n',
            "pkg/cli.py": "def run(): pass\n",
            "pkg/lazy/__init__.py": (
                "import importlib\n_HOME = {'run': 'impl', 'other': 'nowhere'}\n"
                "def __getattr__(n):\n    return importlib.import_module(f'pkg.lazy.{_HOME[n]}')\n"
            ),
            "pkg/lazy/impl.py": "run = 1\n",
        },
    )
    bad = broken_string_imports(pkg)
    assert sorted(bad) == [
        "pkg.errors: no module pkg.gone",
        "pkg.errors: pkg.cli has no missing",
        "pkg.lazy: no module pkg.lazy.nowhere",
    ], bad
    graph = import_graph(pkg)
    assert "pkg.cli" in graph["pkg.errors"] and "pkg.lazy.impl" in graph["pkg.lazy"]
    # errors ranked below cli: the string import from errors to cli points up and is flagged
    assert back_up_imports(graph, ["errors", "cli", "lazy", "pkg"]) == ["pkg.errors -> pkg.cli (errors sits below cli)"]


def test_every_command_and_lazy_name_resolves():
    files = module_files()
    cli = string_imports(files["normswap.cli.main"].read_text(encoding="utf-8"), set(files))
    lazy = string_imports(files["normswap.finetune"].read_text(encoding="utf-8"), set(files))
    assert len(cli) >= 10 and len(lazy) >= 8, (cli, lazy)  # the scan sees both forms
    assert not broken_string_imports(), broken_string_imports()
    graph = import_graph()
    assert {m for m, _ in cli} <= graph["normswap.cli.main"]  # their layer direction is checked with the rest


# -- functions a reader can hold ------------------------------------------------------------------

MAX_FUNCTION_LINES = 100


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions and methods of ``source`` longer than ``limit`` lines (def line to last line), as
    'name (N lines, line L)'; a nested function counts toward its parent and on its own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{node.name} ({length} lines, line {node.lineno})")
    return found


def test_long_function_check_flags_a_planted_one():
    # negative control: 101 lines is flagged, 100 is not, a method and a nested function too
    body = "    x = 1\n"
    assert long_functions("def f():\n" + body * 100) == ["f (101 lines, line 1)"]
    assert long_functions("def f():\n" + body * 99) == []
    nested = "class C:\n    def m(self):\n        def inner():\n" + "            x = 1\n" * 101
    assert long_functions(nested) == ["m (103 lines, line 2)", "inner (102 lines, line 3)"]


def test_no_function_over_100_lines():
    found = [
        f"{rel} {hit}"
        for path in module_files().values()
        for rel in [path.relative_to(ROOT).as_posix()]
        for hit in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not found, "functions over 100 lines (split them):\n" + "\n".join(found)


# -- a package's index names its modules -----------------------------------------------------------


def unindexed(package: Path) -> list[str]:
    """Modules (as ``name.py``) and subpackages (as ``name/``) of ``package`` its ``__init__`` docstring
    does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    modules = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    subpackages = [f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(name for name in modules + subpackages if name not in doc)


def test_unindexed_flags_a_module_the_index_leaves_out(tmp_path):
    # negative control: a module or a subpackage the docstring does not name is reported, a named one is not
    (tmp_path / "__init__.py").write_text('"""Modules: a.py (the first); sub/ (its parts)."""\n')
    (tmp_path / "a.py").write_text("")
    (tmp_path / "b.py").write_text("")
    for name in ("sub", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "data").mkdir()  # a folder that is not a package is not indexed
    assert unindexed(tmp_path) == ["b.py", "other/"]


# The study's concerns, each a subpackage below the options and the plan (normswap/study/__init__.py).
STUDY_CONCERNS = ["training", "measuring", "judging", "persistence", "presentation"]


def test_the_study_index_names_every_module():
    study = PACKAGE / "study"
    assert sorted(p.name for p in study.iterdir() if (p / "__init__.py").is_file()) == sorted(STUDY_CONCERNS)
    top = ast.get_docstring(ast.parse((study / "__init__.py").read_text(encoding="utf-8"))) or ""
    for package in [study] + [study / concern for concern in STUDY_CONCERNS]:
        assert unindexed(package) == [], package
    for concern in STUDY_CONCERNS:
        # the top index names each module under its own concern's heading, as the folders hold them
        section = top[top.index(f"- {concern}/") :].split("\n- ")[0]
        missing = [m.name for m in (study / concern).glob("*.py") if m.name != "__init__.py" and m.name not in section]
        assert not missing, (concern, missing)
