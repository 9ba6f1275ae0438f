"""docs/ARCHITECTURE.md's import directions hold: every import of one of meshppo's packages from another
(at module level or inside a function) is a direction the doc's block states, or one of the exceptions
its list names, each at the place it names; and no exception is listed that the code no longer has."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("trainer", "ppo", "kl", "agent", "data", "rewards", "sharding", "rollout", "models")
# The doc's exceptions: (file, the function the import is in or None for module level, module).
EXCEPTIONS = {
    ("rollout/generate.py", "read_prompts", "data.dataset"),
    ("rollout/generate.py", "_check_out", "trainer.configlib"),
    ("rollout/generate.py", "_check_out", "trainer.setup"),
    ("rollout/generate.py", "main", "trainer.versions"),
    ("data/demo.py", "main", "trainer.configlib"),
    ("data/demo.py", "main", "trainer.setup"),
    ("data/dataset.py", "_prompt_text", "agent.tools"),
    ("data/dataset.py", "_tool_selection", "agent.tools"),
    ("data/dataset.py", "_checked_row", "rewards.registry"),
    ("data/dataset.py", "_tokenized", "trainer.batching"),
    ("agent/loop.py", None, "trainer.errors"),
    ("agent/_load.py", None, "trainer.configlib"),
}
LEAF_MODULES = ("trainer/errors.py", "trainer/configlib.py", "trainer/versions.py")  # imported from below: they import nothing of meshppo's


def _section() -> str:
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    return text.split("## Import directions", 1)[1].split("\n## ", 1)[0]


def _stated_directions() -> dict[str, set[str]]:
    """The block's `source → target, target (a note), ...` lines, as {source: targets}."""
    allowed = {}
    for line in _section().split("```")[1].strip().splitlines():
        sources, targets = line.split(" → ")
        targets = re.sub(r"\([^)]*\)", "", targets)
        names = set() if targets.strip() == "nothing" else {t.strip() for t in targets.split(",")}
        for source in sources.split(","):
            allowed[source.strip()] = names
    return allowed


def _imports(path: str) -> list[tuple[str | None, str]]:
    """(the innermost function around it or None, module) of each absolute import in the file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((function, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.append((function, child.module))
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            visit(child, inner)

    visit(tree, None)
    return found


def _files(package: str) -> list[str]:
    if package.endswith(".py"):
        return [package]
    return sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, names in os.walk(os.path.join(ROOT, package))
                  for f in names if f.endswith(".py"))


def _cross_package_imports():
    """(file, function, module, the file's package) of each import of another of meshppo's packages."""
    for package in ("train_ppo.py",) + PACKAGES:
        for rel in _files(package):
            for function, module in _imports(os.path.join(ROOT, rel)):
                if module.split(".")[0] in PACKAGES and module.split(".")[0] != package:
                    yield rel, function, module, package


def _within(module: str, allowed: set[str]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def test_every_import_follows_the_stated_directions_or_is_a_listed_exception():
    allowed = _stated_directions()
    assert set(allowed) == {"train_ppo.py", *PACKAGES}
    stray = [(rel, function, module) for rel, function, module, package in _cross_package_imports()
             if not _within(module, allowed[package]) and (rel, function, module) not in EXCEPTIONS]
    assert stray == []


def test_each_exception_is_in_the_code_and_named_in_the_doc():
    seen = {(rel, function, module) for rel, function, module, _ in _cross_package_imports()}
    assert EXCEPTIONS <= seen  # a stale one would leave the doc claiming an import the code dropped
    section = _section()
    for rel, function, module in EXCEPTIONS:
        # the doc names the place: a command-line module by its `python -m` name, otherwise the file
        place = rel if function is None or rel == "data/dataset.py" else rel[:-3].replace("/", ".")
        assert place in section and module in section and (function is None or f"`{function}`" in section)


def test_the_modules_imported_from_below_import_nothing_of_meshppos():
    for rel in LEAF_MODULES:
        assert [m for _, m in _imports(os.path.join(ROOT, rel)) if m.split(".")[0] in PACKAGES] == []
