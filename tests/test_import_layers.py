"""The package's layers, checked from the source: imports go downward only, and no import circle.

    cli -> serve -> viz / experiments / bench / export -> runs -> training -> inference
        -> decoding / metrics / pretrained -> models -> nn -> attention -> data / runtime

A module may import from its own package and from any lower layer, never from a higher one or from a
sibling package of its own layer. Function-level (lazy) imports count too: a lazy import of a higher
layer is the same design problem, only hidden. The root ``qkv/__init__.py`` is the public API: it
may import anything, and nothing inside the package imports from it (``__version__`` aside).
"""

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "qkv"

LAYERS = [
    {"runtime"},
    {"data", "attention"},
    {"nn"},
    {"models"},
    {"decoding", "metrics", "pretrained"},
    {"inference"},
    {"training"},
    {"runs"},
    {"viz", "experiments", "bench", "export"},
    {"serve"},
    {"cli"},
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def package_of(module: str) -> str:
    """``qkv.runs.folder`` -> ``runs``; the root modules (``qkv``, ``qkv.__main__``) -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and not parts[1].startswith("__") else ""


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = ("qkv", *path.relative_to(SRC).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, *, top_level_only: bool = False) -> list[tuple[str, int]]:
    """The qkv modules ``path`` imports (``from qkv.x import y`` gives ``qkv.x.y`` when that is a module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "qkv"]
        elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "qkv"
        ):
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def resolve(name: str, known: dict[str, Path]) -> str:
    """The module an imported name lives in: itself if it is a module, else its parent."""
    return name if name in known else name.rsplit(".", 1)[0]


def test_the_layer_table_names_every_package():
    packages = {package_of(m) for m in modules()} - {""}
    assert packages <= set(RANK), f"packages without a layer: {sorted(packages - set(RANK))}"
    assert {"runtime", "nn", "models", "decoding", "metrics", "runs", "training", "cli"} <= packages


def test_imports_go_downward_only():
    known = modules()
    wrong = []
    for module, path in sorted(known.items()):
        own = package_of(module)
        for name, line in imports(path):
            target = resolve(name, known)
            theirs = package_of(target)
            if own == "":  # the public API and python -m qkv
                continue
            if theirs == "":
                if name != "qkv.__version__":
                    wrong.append(f"{path.relative_to(SRC)}:{line} imports the root package ({name})")
                continue
            if theirs != own and RANK[theirs] >= RANK[own]:
                why = "a higher layer" if RANK[theirs] > RANK[own] else "a sibling of its layer"
                wrong.append(f"{path.relative_to(SRC)}:{line} ({own}) imports {target} ({theirs}: {why})")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    """No circle among the modules' imports, lazy ones inside functions and ``TYPE_CHECKING`` ones
    included: a lazy import that breaks a circle at run time still ties the two modules together."""
    known = modules()
    graph = {m: {resolve(n, known) for n, _ in imports(p)} & set(known) for m, p in known.items()}
    # a package's __init__ importing its own submodules is how a package re-exports: not a circle
    for module in graph:
        graph[module] = {t for t in graph[module] if not (module == t.rsplit(".", 1)[0] and t.startswith(module + "."))}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if target == module:
                continue
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import circle: " + " -> ".join(cycle))


# The line caps are a signal that a concept should split, not a rule to satisfy by cutting one concept
# in two. A file or function that truly is one concept longer than the cap is listed here with the
# reason, and then passes; the table is meant to stay empty or nearly so. Keys are paths under
# src/qkv ("data/text.py") for files, and "path:function" ("data/text.py:read_lines") for functions.
LINE_CAP_EXCEPTIONS: dict[str, str] = {
    "experiments/window_recall.py": "one experiment read top to bottom like the others: its task, its variants, "
    "the gradient reach it measures, the claims checked against the measurement, its figure",
    "experiments/gqa_memory_quality.py": "one experiment read top to bottom like the others: its model, its data, "
    "the cache measured from its tensors, the claims checked against the measurement, its figure",
    "experiments/gqa_memory_quality.py:run": "the experiment's steps in order (data, each head count and seed "
    "trained on the same batches, the cache measured from its tensors, the claims), one sequence",
    "export/ctranslate2_lm.py": "one converter: a language model into CTranslate2's decoder spec, its vocabulary, "
    "the folder, and the greedy check against qkv that decides whether the folder is put in place",
    "models/causal_lm.py": "the language model with its config beside it (the house style), and the config holds "
    "the options of today's models (rotary, grouped-query, windows, norms, soft-cap), each checked where declared",
    "training/config.py": "TrainConfig declares every training option once (default, range, help, flag, group), "
    "which qkv train's flags, recipes and the Python API all read; the options are one list",
    "cli/demo.py:run": "the demo's steps in the order a newcomer sees them (train, translate, explore, print where "
    "each file is), with its docstring; splitting it would scatter one sequence",
    "cli/serve.py:add_arguments": "qkv serve's flags: one add_argument each, a flat list with its docstring",
}

FILE_CAP, FUNCTION_CAP = 400, 80


def over_the_caps(path: Path, text: str) -> list[tuple[str, str]]:
    """The file and functions of ``path`` over the caps: (exception key, message) pairs."""
    name = path.relative_to(SRC).as_posix()
    found = []
    if text.count("\n") > FILE_CAP:
        found.append((name, f"{name}: {text.count(chr(10))} lines"))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            span = node.end_lineno - node.lineno + 1
            if span > FUNCTION_CAP:
                found.append((f"{name}:{node.name}", f"{name}:{node.lineno} {node.name}: {span} lines"))
    return found


def test_no_file_over_400_lines_and_no_function_over_80():
    """Every file and function within the caps, or listed in LINE_CAP_EXCEPTIONS with its reason."""
    over = [found for path in sorted(SRC.rglob("*.py")) for found in over_the_caps(path, path.read_text())]
    wrong = [message for key, message in over if key not in LINE_CAP_EXCEPTIONS]
    assert not wrong, "\n".join(wrong) + "\n(split where the concept splits, or add a written exception)"


def test_every_line_cap_exception_is_still_needed_and_says_why():
    """An exception whose file or function is back under the cap (or gone) is removed, not kept."""
    over = {key for path in sorted(SRC.rglob("*.py")) for key, _ in over_the_caps(path, path.read_text())}
    stale = sorted(set(LINE_CAP_EXCEPTIONS) - over)
    assert not stale, f"exceptions no longer needed: {stale}"
    assert all(reason.strip() for reason in LINE_CAP_EXCEPTIONS.values())


def test_the_cap_check_sees_a_long_function(tmp_path, monkeypatch):
    """The check itself: a function one line over the cap is reported, one at the cap is not."""
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_CAP - 2))
    at_cap = f"def f():\n{body}\n    return 0\n"
    over_cap = f"def g():\n{body}\n    x = 1\n    return 0\n"
    (tmp_path / "m.py").write_text(at_cap + over_cap)
    keys = [key for key, _ in over_the_caps(tmp_path / "m.py", at_cap + over_cap)]
    assert keys == ["m.py:g"]


def test_library_code_never_prints():
    """Only the CLI prints; library code logs (``logging``) or returns what a caller shows."""
    printing = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                printing.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not printing, "print() outside qkv.cli: " + ", ".join(printing)


def package_arrows(src: Path = SRC) -> tuple[int, int]:
    """The number of packages of ``src`` and of import arrows between two of them (each pair once):
    what docs/architecture.md's before-and-after table counts."""
    known = modules_of(src)
    arrows = set()
    for module, path in known.items():
        own = package_of(module)
        for name, _ in imports(path):
            theirs = package_of(resolve(name, known))
            if own and theirs and own != theirs:
                arrows.add((own, theirs))
    return len({package_of(m) for m in known} - {""}), len(arrows)


def modules_of(src: Path) -> dict[str, Path]:
    """:func:`modules` of another source tree (an earlier commit's ``src/qkv``)."""
    found = {}
    for path in src.rglob("*.py"):
        parts = ("qkv", *path.relative_to(src).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def test_the_arrow_count_counts_each_pair_of_packages_once():
    packages, arrows = package_arrows()
    assert packages == len(set(RANK) & {package_of(m) for m in modules()}) and 0 < arrows < packages * packages


if __name__ == "__main__":  # python tests/test_import_layers.py [SRC]: the packages and the arrows between them
    packages, arrows = package_arrows(Path(sys.argv[1]) if len(sys.argv) > 1 else SRC)
    print(f"packages {packages}, arrows between them {arrows}")
