"""fddp's house drawn from its imports: rooms on floors, an arrow for each import between rooms.

    python docs/house.py    # writes docs/images/house.svg, shown on docs/architecture.md

A room is a top-level entry of ``fddp/`` (a folder, or a module such as ``_batches`` or
``optim``); a room's floor is the length of the longest chain of imports below it, so a room
imports only from floors beneath its own. ``tests/test_layering.py`` reads fddp's imports with
this module's reader and fails when the committed picture is not what this script writes now.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import html
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fddp"
PICTURE = ROOT / "docs" / "images" / "house.svg"

WIDTH = 1280
FLOOR_HEIGHT = 78
ROOM_WIDTH = 190  # at least; a room with many arrows is wider, so that they stay apart
ARROW_SPACING = 18
ROOM_HEIGHT = 40
MARGIN = 24
LABEL_WIDTH = 90  # the floor numbers on the left


@dataclasses.dataclass(frozen=True)
class Import:
    target: str  # a module of fddp, dotted: "fddp._base._tree"
    line: int
    name: str | None = None  # the name imported from ``target``; None: the module itself
    bound: str = ""  # the name the import binds in the importing module


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of fddp by dotted name (a package by its own name)."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def fddp_imports(path: Path) -> list[Import]:
    """The fddp modules ``path`` imports, at module level, inside functions and under
    ``if TYPE_CHECKING:`` alike."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [
                Import(a.name, node.lineno, None, a.asname or a.name.partition(".")[0])
                for a in node.names
                if _ours(a.name)
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not _ours(source):
                continue
            for alias in node.names:  # ``from fddp import _tree`` imports the module
                submodule = f"{source}.{alias.name}"
                bound = alias.asname or alias.name
                if submodule in modules():
                    found.append(Import(submodule, node.lineno, None, bound))
                else:
                    found.append(Import(source, node.lineno, alias.name, bound))
    return [i for i in found if i.target != module]


def _ours(name: str) -> bool:
    return name == "fddp" or name.startswith("fddp.")


def target_module(name: str) -> str:
    """The module an import resolves to: ``import fddp._compiler._plan`` is that module."""
    while name not in modules() and "." in name:
        name = name.rpartition(".")[0]
    return name


def room_of(module: str) -> str:
    """The top-level entry of fddp/ that holds ``module``: "_compiler", "optim", "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_imports() -> dict[str, set[str]]:
    """Each room and the other rooms it imports from."""
    graph: dict[str, set[str]] = {room_of(m): set() for m in modules()}
    for module, path in modules().items():
        for imp in fddp_imports(path):
            target = room_of(target_module(imp.target))
            if target != room_of(module):
                graph[room_of(module)].add(target)
    return graph


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each room's floor: 0 for a room that imports no other, else one above its highest import."""
    found: dict[str, int] = {}

    def floor(room: str, trail: tuple[str, ...]) -> int:
        if room in trail:
            raise ValueError(f"rooms import in a circle: {' -> '.join((*trail, room))}")
        if room not in found:
            below = [floor(r, (*trail, room)) for r in sorted(graph[room])]
            found[room] = 1 + max(below) if below else 0
        return found[room]

    for room in sorted(graph):
        floor(room, ())
    return found


@dataclasses.dataclass(frozen=True)
class Box:
    x: int  # the centre
    y: int
    width: int


def layout(graph: dict[str, set[str]], floor: dict[str, int]) -> dict[str, Box]:
    """Each room's box: floor 0 at the bottom; on a floor, rooms ordered by where
    the rooms they import from stand (then by name), so that arrows cross little."""
    top = max(floor.values())
    height = MARGIN * 2 + (top + 1) * FLOOR_HEIGHT
    span = WIDTH - LABEL_WIDTH - 2 * MARGIN
    middle = LABEL_WIDTH + MARGIN + span // 2
    x: dict[str, int] = {}
    boxes: dict[str, Box] = {}
    users = {r: sum(r in graph[s] for s in graph) for r in graph}

    def weight(room: str) -> tuple[float, str]:
        below = [x[r] for r in graph[room]]
        return (sum(below) / len(below) if below else middle, room)

    for level in range(top + 1):
        rooms = sorted((r for r in graph if floor[r] == level), key=weight)
        step = span // len(rooms)
        y = height - MARGIN - FLOOR_HEIGHT * level - FLOOR_HEIGHT // 2
        for i, room in enumerate(rooms):
            x[room] = LABEL_WIDTH + MARGIN + step * i + step // 2
            arrows = max(len(graph[room]), users[room])
            width = min(step - 16, max(ROOM_WIDTH, ARROW_SPACING * arrows + 30))
            boxes[room] = Box(x[room], y, width)
    return boxes


def _spread(box: Box, count: int, index: int) -> int:
    """The ``index``-th of ``count`` points spread along the edge of ``box``."""
    usable = box.width - 30
    return box.x - usable // 2 + (usable * (2 * index + 1)) // (2 * count)


def svg() -> str:
    """The picture of the house, as SVG text (the same text for the same imports)."""
    graph = room_imports()
    floor = floors(graph)
    box = layout(graph, floor)
    top = max(floor.values())
    height = MARGIN * 2 + (top + 1) * FLOOR_HEIGHT
    out_of = {r: sorted(graph[r], key=lambda t: (box[t].x, t)) for r in graph}
    into = {
        r: sorted((s for s in graph if r in graph[s]), key=lambda s: (box[s].x, s)) for r in graph
    }
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="15">',
        "<title>fddp's rooms on their floors; an arrow points from a room to one it imports "
        "(generated by docs/house.py)</title>",
        '<defs><marker id="head" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
        'fill="#8a8f98"/></marker></defs>',
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
    ]
    for level in range(top + 1):
        y = height - MARGIN - FLOOR_HEIGHT * (level + 1)
        fill = "#f4f6f8" if level % 2 == 0 else "#ffffff"
        lines.append(
            f'<rect x="{MARGIN}" y="{y}" width="{WIDTH - 2 * MARGIN}" height="{FLOOR_HEIGHT}" '
            f'fill="{fill}"/>'
        )
        lines.append(
            f'<text x="{MARGIN + 10}" y="{y + FLOOR_HEIGHT // 2 + 5}" fill="#5f6670">'
            f"floor {level}</text>"
        )
    for room in sorted(graph):
        for index, target in enumerate(out_of[room]):
            x1 = _spread(box[room], len(out_of[room]), index)
            y1 = box[room].y + ROOM_HEIGHT // 2
            x2 = _spread(box[target], len(into[target]), into[target].index(room))
            y2 = box[target].y - ROOM_HEIGHT // 2
            bend = (y2 - y1) // 2
            lines.append(
                f'<path d="M {x1} {y1} C {x1} {y1 + bend} {x2} {y2 - bend} {x2} {y2}" '
                'fill="none" stroke="#8a8f98" stroke-opacity="0.55" stroke-width="1.2" '
                'marker-end="url(#head)"/>'
            )
    for room in sorted(graph):
        x, y, width = box[room].x, box[room].y, box[room].width
        public = not room.startswith("_") or room == "__init__"
        fill, stroke = ("#fff4d6", "#b98900") if public else ("#dbe9f7", "#2f6fae")
        label = room + ("/" if (PACKAGE / room).is_dir() else "")
        label = "fddp (__init__)" if room == "__init__" else label
        lines.append(
            f'<rect x="{x - width // 2}" y="{y - ROOM_HEIGHT // 2}" width="{width}" '
            f'height="{ROOM_HEIGHT}" rx="6" fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>'
        )
        lines.append(
            f'<text x="{x}" y="{y + 5}" text-anchor="middle" fill="#1d2733">'
            f"{html.escape(label)}</text>"
        )
    lines += _legend(WIDTH - MARGIN - 250, MARGIN + 12)
    lines.append("</svg>")
    return "\n".join(lines) + "\n"


def _legend(x: int, y: int) -> list[str]:
    return [
        f'<rect x="{x}" y="{y}" width="16" height="12" rx="3" fill="#dbe9f7" stroke="#2f6fae"/>',
        f'<text x="{x + 24}" y="{y + 11}" font-size="13" fill="#1d2733">a private room</text>',
        f'<rect x="{x}" y="{y + 20}" width="16" height="12" rx="3" fill="#fff4d6" '
        'stroke="#b98900"/>',
        f'<text x="{x + 24}" y="{y + 31}" font-size="13" fill="#1d2733">a public module</text>',
        f'<path d="M {x} {y + 46} L {x + 16} {y + 46}" stroke="#8a8f98" stroke-width="1.2" '
        'marker-end="url(#head)"/>',
        f'<text x="{x + 24}" y="{y + 51}" font-size="13" fill="#1d2733">imports from</text>',
    ]


def main() -> int:
    PICTURE.parent.mkdir(parents=True, exist_ok=True)
    PICTURE.write_text(svg())
    print(f"wrote {PICTURE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
