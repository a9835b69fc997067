"""Repository rules: family code stays in its folder, and imports go one way through the layers.

Layers (a module may import its own layer and the ones below, never one above, not even inside a function):
  1 types      types.py (proposals, feedback, verification results, outputs), configuration_utils.py, layers.py,
               features.py, text_files.py (reading users' text files)
  2 core       modeling_utils, verification/, tree/, convert.py (the layout registry), checkpoint_files.py
               (folder or Hub repo files), speculators_format.py (the speculators envelope), registry.py, auto.py,
               cards.py (model cards and push)
  3 families   models/<family>/ (a family never imports another family), testing.py (the replay drafter)
  4 consumers  generation/ (the loop, the hook), training/, bench/
  5 top        commands/ (the command line), demo.py, selfcheck.py, the package's __init__.py and __main__.py
"""

import ast
import os
import re
import tokenize

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "hf_specdec")
# A family name anywhere in a word ("Eagle3Config", "eagle3_drafter", "EAGLE-3"), except "mtp", which is only a
# name when it is not part of a longer word, and "eagle2" / "EAGLE-2", which names a tree policy (the dynamic tree of
# hf_specdec.tree, usable with any drafter that drafts trees), not a drafter family.
FAMILY_RE = re.compile(
    r"eagle(?!-?2(?![0-9]))|medusa|hydra|blockwise|dflash|dspark|specblock|(?<![a-z])mtp(?![a-z])", re.IGNORECASE
)

TYPES, CORE, FAMILIES, CONSUMERS, TOP = 1, 2, 3, 4, 5
LAYER_NAMES = {TYPES: "types", CORE: "core", FAMILIES: "families", CONSUMERS: "consumers", TOP: "top"}
LAYERS = {
    "types": TYPES,
    "configuration_utils": TYPES,
    "layers": TYPES,
    "context_vocab": TYPES,
    "features": TYPES,
    "text_files": TYPES,
    "cpu_kernels": TYPES,
    "modeling_utils": CORE,
    "heads": CORE,
    "feature_drafting": CORE,
    "verification": CORE,
    "tree": CORE,
    "convert": CORE,
    "checkpoint_files": CORE,
    "speculators_format": CORE,
    "registry": CORE,
    "auto": CORE,
    "cards": CORE,
    "models": FAMILIES,
    "testing": FAMILIES,
    "generation": CONSUMERS,
    "training": CONSUMERS,
    "bench": CONSUMERS,
    "chat_prompts": CONSUMERS,
    "gguf_target": CONSUMERS,
    "assistant": CONSUMERS,
    "commands": TOP,
    "demo": TOP,
    "selfcheck": TOP,
    "__init__": TOP,
    "__main__": TOP,
}


def _python_files(root=SRC):
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, SRC)[: -len(".py")].replace(os.sep, ".")
    return rel.removesuffix(".__init__") if rel != "__init__" else "__init__"


def _is_package(module: str) -> bool:
    return os.path.isfile(os.path.join(SRC, *module.split("."), "__init__.py"))


def layer_of(module: str) -> int:
    """Longest prefix of ``module`` in LAYERS (``models.eagle3.modeling_eagle3`` -> ``models``)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise AssertionError(f"hf_specdec.{module} has no layer: add it to LAYERS in tests/test_repository.py")


def _executed_at_import(tree: ast.AST):
    """The nodes that run when the module is imported: not function bodies, not ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_executed_at_import(child)])
            continue
        yield node
        yield from _executed_at_import(node)


def imports_of(path: str, at_import_only: bool = False) -> list[tuple[str, int]]:
    """Every hf_specdec module ``path`` imports (module level and inside functions, or with ``at_import_only`` only
    those its import runs), with line numbers."""
    module = _module_name(path)
    package = module if (_is_package(module) or module == "__init__") else module.rpartition(".")[0]
    package = "" if package == "__init__" else package
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    for node in _executed_at_import(tree) if at_import_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "hf_specdec" or alias.name.startswith("hf_specdec."):
                    found.append((alias.name.removeprefix("hf_specdec").lstrip(".") or "__init__", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "hf_specdec" or node.module.startswith("hf_specdec.")):
                target = node.module.removeprefix("hf_specdec").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import cards` imports the submodule `cards`
                if not target and alias.name.startswith("__"):
                    continue  # package metadata (`from .. import __version__`): the root is loaded first anyway
                sub = f"{target}.{alias.name}" if target else alias.name
                if alias.name != "*" and (
                    _is_package(sub) or os.path.isfile(os.path.join(SRC, *sub.split(".")) + ".py")
                ):
                    found.append((sub, node.lineno))
                else:
                    found.append((target or "__init__", node.lineno))
    return found


def test_no_family_name_outside_models():
    """Consumers learn about families from the registry: no family name in code, strings or file names."""
    offenders = []
    models = os.path.join(SRC, "models")
    for folder, dirs, files in os.walk(SRC):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if folder == models or folder.startswith(models + os.sep):
            continue
        for name in dirs + files:
            if FAMILY_RE.search(name):
                offenders.append(f"{os.path.relpath(os.path.join(folder, name), SRC)}: file name")
    for path in _python_files():
        if path.startswith(models + os.sep):
            continue
        with open(path, "rb") as fh:
            for tok in tokenize.tokenize(fh.readline):
                if tok.type in (tokenize.NAME, tokenize.STRING) and FAMILY_RE.search(tok.string):
                    word = FAMILY_RE.search(tok.string).group(0)
                    offenders.append(f"{os.path.relpath(path, SRC)}:{tok.start[0]}: {word!r} in {tok.string[:60]!r}")
    assert not offenders, "family names outside models/:\n" + "\n".join(offenders)


def test_family_name_check_can_fail(tmp_path):
    """The pattern catches identifiers and strings of every kind it should, and leaves ordinary words alone."""
    for text in ("Eagle3Config", "eagle3_drafter", "EAGLE-3", "MedusaHead", "use_mtp", "MTP", "DFlash", "dspark"):
        assert FAMILY_RE.search(text), text
    for text in ("attempt", "template", "block_size", "speculative", "hidden_states"):
        assert not FAMILY_RE.search(text), text


def layer_violations() -> list[str]:
    violations = []
    for path in _python_files(SRC):
        module = _module_name(path)
        own = layer_of(module)
        for imported, line in imports_of(path):
            theirs = layer_of(imported)
            where = f"hf_specdec.{module} (line {line}) imports hf_specdec.{imported}"
            if theirs > own:
                violations.append(f"{where}: {LAYER_NAMES[own]} -> {LAYER_NAMES[theirs]}")
            elif module.startswith("models.") and imported.startswith("models."):
                mine, other = module.split(".")[1], imported.split(".")[1:2]
                if other and other[0] != mine and _is_package(f"models.{mine}"):
                    violations.append(f"{where}: one family imports another")
    return violations


def test_imports_go_one_way():
    violations = layer_violations()
    assert not violations, "imports against the layers:\n" + "\n".join(violations)


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """What importing each module runs: its module-level imports, and with each the ``__init__`` of every package
    above the imported module (``from ..generation.proposals import X`` runs ``generation/__init__``), except the
    packages that hold the importing module itself (those are already running)."""
    graph: dict[str, set[str]] = {}
    for path in _python_files(SRC):
        module = _module_name(path)
        mine = set(_ancestors(module)) | {module}
        edges = graph.setdefault(module, set())
        for imported, _ in imports_of(path, at_import_only=True):
            edges.update(m for m in [*_ancestors(imported), imported] if m not in mine and m != "__init__")
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (depth-first search)."""
    cycles, done = [], set()

    def visit(node, stack, on_stack):
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in done:
                on_stack.add(nxt)
                visit(nxt, stack + [nxt], on_stack)
                on_stack.discard(nxt)
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start], {start})
    return cycles


def test_module_level_imports_form_no_cycle():
    """Importing any module never comes back to one still being imported, counting the package ``__init__`` files an
    import runs: so no import needs deferring into a function to break a cycle."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(f"hf_specdec.{m}" for m in c) for c in cycles)


def test_cycle_check_can_fail(tmp_path, monkeypatch):
    """A type module under a package whose ``__init__`` imports the loop, which imports a verifier that imports the
    type: the cycle runs through the ``__init__``, and the check finds it; a function-level import is not one."""
    import test_repository as rules

    fake = tmp_path / "hf_specdec"
    (fake / "generation").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "generation" / "__init__.py").write_text("from .loop import run\n")
    (fake / "generation" / "loop.py").write_text("from ..verifier import verify\n")
    (fake / "generation" / "proposals.py").write_text("")
    (fake / "verifier.py").write_text("def verify():\n    from . import cli\nfrom .generation.proposals import P\n")
    (fake / "cli.py").write_text("from .generation import run\n")
    monkeypatch.setattr(rules, "SRC", str(fake))
    graph = rules.import_graph()
    assert ["generation", "generation.loop", "verifier", "generation"] in rules.import_cycles(graph)
    assert "cli" not in graph["verifier"]
    (fake / "verifier.py").write_text("from .types import P\n")
    assert rules.import_cycles(rules.import_graph()) == []


@pytest.mark.parametrize(
    "source, module, bad",
    [
        ("from .commands import main\n", "modeling_utils", True),  # core -> top
        ("def f():\n    from ...training.trainer import x\n", "models.fam.modeling_fam", True),  # in a function
        ("import hf_specdec.commands\n", "registry", True),
        ("from ..other import y\n", "models.fam.modeling_fam", True),  # a family importing another family
        ("from ...layers import RMSNorm\n", "models.fam.modeling_fam", False),
        ("from .registry import DRAFTERS\nfrom . import __version__\n", "commands", False),
    ],
)
def test_import_check_can_fail(tmp_path, monkeypatch, source, module, bad):
    """The layering check flags what it should, on a fake module tree."""
    import test_repository as rules

    fake_src = tmp_path / "hf_specdec"
    for name in ("models/fam", "models/other", "training"):
        (fake_src / name).mkdir(parents=True, exist_ok=True)
        (fake_src / name / "__init__.py").write_text("")
    for name in ("__init__", "models/__init__", "cards", "commands", "registry", "layers", "modeling_utils"):
        (fake_src / f"{name}.py").write_text("")
    for name in ("models/fam/modeling_fam", "training/trainer"):
        (fake_src / f"{name}.py").write_text("")
    (fake_src / (module.replace(".", "/") + ".py")).write_text(source)
    monkeypatch.setattr(rules, "SRC", str(fake_src))
    assert bool(rules.layer_violations()) == bad


MAX_FUNCTION_LINES = 100


def long_functions(src: str | None = None) -> list[str]:
    """Functions (docstring included) longer than MAX_FUNCTION_LINES lines."""
    found = []
    for path in _python_files(src or SRC):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{os.path.relpath(path, src or SRC)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_is_longer_than_a_screenful_or_two():
    """A function a newcomer must read as a whole stays short: split a longer one into named steps."""
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_the_length_check_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert [f.split(" ")[1] for f in long_functions(str(tmp_path))] == ["long:"]
