"""Every fddp module imports only from the layers docs/architecture.md's table lets it."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re

from docs.house import PACKAGE, PICTURE, ROOT, fddp_imports, modules, svg, target_module

PAGE = ROOT / "docs" / "architecture.md"
TABLE_HEADING = "## Layers"
COMPILER_HEADING = "## Rooms of the compiler"
DEVELOPER_HEADING = "## Developer entry points"
BENCHMARKS = ROOT / "benchmarks"


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    entries: tuple[str, ...]  # "_batches" is fddp/_batches.py, "_compiler/" every module under it
    may_import: frozenset[str]  # besides its own layer


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def _table(heading: str) -> list[list[str]]:
    """The rows of the table under ``heading`` in docs/architecture.md, header first."""
    lines = PAGE.read_text().splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append(_cells(line))
        elif rows:
            break
    header, _, *body = rows
    return [header, *body]


@functools.cache
def layers() -> tuple[Layer, ...]:
    """The rows of the table under ``## Layers`` in docs/architecture.md, bottom layer first."""
    header, *body = _table(TABLE_HEADING)
    assert header[:3] == ["Layer", "Rooms", "May import"], header
    table = []
    for name, rooms, may, *_ in body:
        below = set() if may == "nothing" else {m.strip() for m in may.split(",")}
        table.append(Layer(name, tuple(re.findall(r"`([^`]+)`", rooms)), frozenset(below)))
    return tuple(table)


def entry_of(module: str) -> str:
    """How the table writes ``module``: "_base/_tree", "__init__", "_compiler/_passes/_bucket"."""
    rest = module.removeprefix("fddp").removeprefix(".")
    return rest.replace(".", "/") or "__init__"


def matches(entry: str, module: str) -> bool:
    name = entry_of(module)
    if entry.endswith("/"):
        return name.startswith(entry) or name == entry.rstrip("/")
    return name == entry


def layer_of(module: str) -> list[Layer]:
    return [layer for layer in layers() if any(matches(e, module) for e in layer.entries)]


def test_the_table_is_ordered_bottom_up():
    seen: set[str] = set()
    for layer in layers():
        assert layer.may_import <= seen, (
            f"docs/architecture.md: layer {layer.name!r} may import "
            f"{sorted(layer.may_import - seen)}, which are not rows above it: a layer imports "
            "only from layers listed before it"
        )
        seen.add(layer.name)


def test_every_module_is_in_exactly_one_layer():
    problems = []
    for module, path in modules().items():
        found = layer_of(module)
        where = path.relative_to(ROOT)
        if not found:
            entry = entry_of(module)
            folder = f" (or its folder `{entry.rpartition('/')[0]}/`)" if "/" in entry else ""
            problems.append(
                f"{where} is in no layer: add `{entry}`{folder} to the row of its layer in "
                "docs/architecture.md's table (the layers its imports come from decide the "
                "lowest it can sit in)"
            )
        elif len(found) > 1:
            problems.append(f"{where} is in layers {[layer.name for layer in found]}: keep one")
    for layer in layers():
        for entry in layer.entries:
            if not any(matches(entry, m) for m in modules()):
                problems.append(
                    f"docs/architecture.md: `{entry}` in layer {layer.name!r} names no module "
                    "of fddp: remove it or fix its name"
                )
    assert not problems, "\n".join(problems)


def test_each_module_imports_only_from_the_layers_it_may():
    problems = []
    for module, path in modules().items():
        (layer,) = layer_of(module) or [None]
        if layer is None:
            continue  # reported by test_every_module_is_in_exactly_one_layer
        allowed = layer.may_import | {layer.name}
        for imp in fddp_imports(path):
            target = target_module(imp.target)
            (other,) = layer_of(target) or [None]
            if other is not None and other.name not in allowed:
                problems.append(
                    f"{path.relative_to(ROOT)}:{imp.line} ({layer.name}) imports {target} "
                    f"({other.name}): {layer.name} may import only "
                    f"{', '.join(sorted(allowed))} (docs/architecture.md)"
                )
    assert not problems, "\n".join(problems)


def test_no_import_circles():
    graph = {
        module: {target_module(i.target) for i in fddp_imports(path)}
        for module, path in modules().items()
    }
    done: set[str] = set()
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            circles.append(" -> ".join([*trail[trail.index(module) :], module]))
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, (
        "import circles (an import under `if TYPE_CHECKING:` or inside a function counts: move "
        "what both need into a module below them):\n" + "\n".join(circles)
    )


@functools.cache
def compiler_rooms() -> tuple[tuple[str, ...], ...]:
    """The rooms of ``## Rooms of the compiler``, in compile order (a row's rooms side by side)."""
    _, *body = _table(COMPILER_HEADING)
    return tuple(tuple(re.findall(r"`([^`]+)`", cells[0])) for cells in body)


def compiler_room_of(module: str) -> int | None:
    """The row of ``module``'s room in the compiler's table (None outside the compiler)."""
    if not entry_of(module).startswith("_compiler/") or module == "fddp._compiler":
        return None
    found = [i for i, row in enumerate(compiler_rooms()) if any(matches(e, module) for e in row)]
    assert len(found) == 1, f"{module} is in compiler rooms {found}: add it to exactly one row"
    return found[0]


def test_the_compiler_imports_only_rooms_before_its_own():
    problems = []
    for module, path in modules().items():
        mine = compiler_room_of(module)
        if mine is None:
            continue
        for imp in fddp_imports(path):
            target = target_module(imp.target)
            theirs = compiler_room_of(target)
            if theirs is not None and theirs > mine:
                problems.append(
                    f"{path.relative_to(ROOT)}:{imp.line} imports {target}, a compiler room "
                    f"listed after its own ({', '.join(compiler_rooms()[mine])}): the compiler "
                    "reads in compile order (docs/architecture.md, Rooms of the compiler)"
                )
    assert not problems, "\n".join(problems)


def test_the_top_level_names_concepts():
    """``ls fddp/`` is the list of rooms: a folder per concept, the public modules, nothing else."""
    named = {e.rstrip("/") for layer in layers() for e in layer.entries if "/" not in e.rstrip("/")}
    present = {
        p.stem if p.suffix == ".py" else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }
    assert present <= named, f"top-level entries missing from the layer table: {present - named}"


def developer_entry_points() -> dict[str, frozenset[str]]:
    """The table under ``## Developer entry points``: private module -> the names benchmarks
    may use of it."""
    header, *body = _table(DEVELOPER_HEADING)
    assert header[:2] == ["Module", "Names"], header
    return {
        re.findall(r"`([^`]+)`", module)[0]: frozenset(re.findall(r"`([^`]+)`", names))
        for module, names, *_ in body
    }


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


def _attributes_of(tree: ast.AST, name: str) -> set[str]:
    """The attributes a module uses of the name ``name`` it bound: ``_bucket.assign`` -> assign."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == name
    }


def test_benchmarks_use_only_public_names_and_developer_entry_points():
    entry_points = developer_entry_points()
    problems = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for imp in fddp_imports(path):
            if not _private(imp.target):
                continue
            used = {imp.name} if imp.name else _attributes_of(tree, imp.bound)
            unlisted = sorted(used - entry_points.get(imp.target, frozenset()))
            if unlisted or not used:
                what = ", ".join(unlisted) or "the module itself"
                problems.append(
                    f"{path.relative_to(ROOT)}:{imp.line} uses {what} of {imp.target}, which is "
                    "not a developer entry point: use the public API, or add the name to the "
                    "table under 'Developer entry points' in docs/architecture.md with what it "
                    "is for"
                )
    assert not problems, "\n".join(problems)


def test_the_picture_of_the_house_is_the_one_its_imports_draw():
    committed = PICTURE.read_text() if PICTURE.exists() else ""
    assert committed == svg(), (
        "docs/images/house.svg is not the house that fddp's imports draw now: run "
        "python docs/house.py and commit the picture"
    )
