"""The house stays walkable (STYLE.md, "Growing the house"): no package folder holds more than 12 modules."""

from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "tinyserve"
MAX_MODULES = 12


def _modules_by_folder() -> dict[str, list[str]]:
    folders = {}
    for init in PACKAGE.rglob("__init__.py"):
        folder = init.parent
        generated = folder.name == "proto"  # protoc's output, one module per file it writes
        modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py" and not generated]
        folders[str(folder.relative_to(PACKAGE.parent))] = modules
    return folders


def test_no_package_folder_has_more_than_twelve_modules():
    folders = _modules_by_folder()
    assert {"tinyserve/engine/loop", "tinyserve/server/intake", "tinyserve/layers/kernels"} <= set(folders)
    crowded = {folder: len(modules) for folder, modules in folders.items() if len(modules) > MAX_MODULES}
    assert not crowded, f"split these by concern: {crowded}"
