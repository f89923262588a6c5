"""docs/ARCHITECTURE.md stays one page and true: at most 120 lines, and every path, module, class, function
and flag it names exists (read with `ast`, nothing imported)."""

import ast
import re
from pathlib import Path

from tinyserve.cli import build_parser

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _definitions() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Module basename -> its top-level names; class name -> its attributes (methods, fields)."""
    modules, classes = {}, {}
    for path in (ROOT / "tinyserve").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = modules.setdefault(path.stem, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                names.update(t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                             if isinstance(t, ast.Name))
            if isinstance(node, ast.ClassDef):
                attrs = classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        attrs.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        attrs.add(item.target.id)
                attrs.update(t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute)  # self.x = ...
                             and isinstance(t.ctx, ast.Store) and isinstance(t.value, ast.Name) and t.value.id == "self")
    return modules, classes


def _flags() -> set[str]:
    parser = build_parser()
    found = set()
    for action in parser._subparsers._group_actions[0].choices.values():  # every subcommand's parser
        for option in action._actions:
            found.update(s for s in option.option_strings if s.startswith("--"))
    return found


def _resolves(name: str, modules, classes, flags) -> bool:
    if name.endswith("/"):  # a folder: the repository's, the package's, or a sub-package
        return (ROOT / name).is_dir() or any(p.is_dir() and p.name == name.strip("/").split("/")[-1]
                                             for p in (ROOT / "tinyserve").rglob("*"))
    name = name.removesuffix("()")
    if name.startswith("--"):
        return name in flags
    if "/" in name or name.endswith((".py", ".md")):
        candidates = [ROOT / name, ROOT / "tinyserve" / name]
        if name.startswith(("server/", "engine/", "layers/", "loader/", "parallel/", "models/", "bench/")):
            candidates = [ROOT / "tinyserve" / name]
        siblings = [p / name for p in (ROOT / "tinyserve").rglob("*") if p.is_dir()]  # `completions.py` beside chat.py
        return any(p.exists() for p in candidates + siblings)
    head, _, attr = name.partition(".")
    if attr:
        return attr in classes.get(head, ()) or attr in modules.get(head, ()) or (head == "tinyserve" and attr in modules)
    return (name in classes or name in modules or any(name in names for names in modules.values())
            or any(name in attrs for attrs in classes.values()))


def test_architecture_is_one_page_and_every_name_in_it_exists():
    text = DOC.read_text()
    assert len(text.splitlines()) <= 120
    modules, classes = _definitions()
    flags = _flags()
    named = set(re.findall(r"`([^`\s]+)`", text))
    # the package map's code block names modules, folders and classes too
    block = text.split("```")[1]
    named |= {word for word in re.findall(r"[\w/.]+", block) if word != "/" and (word.endswith((".py", "/")) or
              (word[:1].isupper() and word in classes))}
    assert len(named) > 40
    missing = sorted(name for name in named if not _resolves(name, modules, classes, flags))
    assert not missing, f"docs/ARCHITECTURE.md names what does not exist: {missing}"


def test_the_check_fails_on_a_name_that_does_not_exist():
    modules, classes = _definitions()
    for wrong in ("LLMEngine._release", "server/intake.py", "--max-prompts", "Scheduler.plan", "ChatMessage",
                  "engine/sched/", "max_num_sequences"):
        assert not _resolves(wrong, modules, classes, _flags()), wrong
