"""Griffe extension: reads fddp's docstrings as the Google style they are written in."""

from __future__ import annotations

import re
from typing import Any

import griffe

# "Example:" is an admonition to griffe (its body would render as prose); "Examples:" is the
# section that renders ">>>" lines as code.
_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.M)
# Sphinx roles (:func:`x`) read as code in Markdown.
_ROLE = re.compile(r":(?:func|class|data|meth|attr|mod|exc|obj):`~?([^`]+)`")
# A doctest at the left margin, outside any section: Markdown would read ">>>" as quotes.
_BARE_DOCTEST = re.compile(r"^>>> .*(?:\n(?!\s*$).*)*", re.M)
# An RST simple table of two columns (borders of "=" runs): a Markdown table.
_RST_TABLE = re.compile(r"^(=+) +=+\n((?:.*\n)*?)=+ +=+$", re.M)


def _markdown_table(m: re.Match[str]) -> str:
    cut = len(m.group(1)) + 1
    rows = [(line[:cut].strip(), line[cut:].strip()) for line in m.group(2).splitlines()]
    return "\n".join(["| | |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


# A NamedTuple's constructor arguments are its fields: its "Args:" are attributes.
_ARGS_HEADING = re.compile(r"^(\s*)Args:\s*$", re.M)
# "a, b, c: as for ..." in Args: one entry per parameter, each with the shared description.
_SHARED_ARGS = re.compile(r"^(\s+)(\w+(?:, \w+)+): (.*)$", re.M)


class FddpDocstrings(griffe.Extension):
    """Rewrites each docstring once, when its object is created."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        text = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
        text = _ROLE.sub(r"`\1`", text)
        text = _RST_TABLE.sub(_markdown_table, text)
        text = _BARE_DOCTEST.sub(lambda m: f"```pycon\n{m.group(0)}\n```", text)
        if isinstance(obj, griffe.Function):
            params = {p.name for p in obj.parameters}

            def split(m: re.Match[str]) -> str:
                names = m.group(2).split(", ")
                if not params.issuperset(names):
                    return m.group(0)
                return "\n".join(f"{m.group(1)}{name}: {m.group(3)}" for name in names)

            text = _SHARED_ARGS.sub(split, text)
        if isinstance(obj, griffe.Class) and any(
            str(base).endswith("NamedTuple") for base in obj.bases
        ):
            text = _ARGS_HEADING.sub(r"\1Attributes:", text)
        obj.docstring.value = text
