"""Griffe extension that lists the members of each class in the order its source defines them.

mkdocstrings reads lucid_replay by inspection (``force_inspection`` in mkdocs.yml), because the
constructors of the attrs classes only exist at runtime. Inspection finds members in ``dir()``
order, which is alphabetical, and gives properties no line number; and members reached through
a re-export such as ``lucid_replay.SequenceReplay`` are sorted by a line number of their own
that they do not have. ``members_order: source`` therefore fell back to alphabetical order.
This extension gives each member of an inspected class the line of its definition in the class
body and stores the members in that order, so the reference reads like the source.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from typing import Any

import griffe


def _definition_lines(cls: type) -> dict[str, int]:
    """Line number of each name a class body defines (def, class, assignment), first wins."""
    try:
        lines, start = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    body = ast.parse(textwrap.dedent("".join(lines))).body
    if not body or not isinstance(body[0], ast.ClassDef):
        return {}
    found: dict[str, int] = {}
    for node in body[0].body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        else:
            continue
        for name in names:
            found.setdefault(name, start + node.lineno - 1)
    return found


class SourceOrder(griffe.Extension):
    """Order an inspected class's members as its source does, and give each its line."""

    def on_class_members(
        self,
        *,
        node: ast.AST | griffe.ObjectNode,
        cls: griffe.Class,
        agent: griffe.Visitor | griffe.Inspector,
        **kwargs: Any,
    ) -> None:
        """Reorder ``cls.members`` by definition line (names not in the body go last)."""
        if not isinstance(node, griffe.ObjectNode):
            return  # static analysis already records members in source order
        lines = _definition_lines(node.obj)
        if not lines:
            return
        for name, member in cls.members.items():
            if not member.is_alias and member.lineno is None and name in lines:
                member.lineno = lines[name]
        ordered = sorted(cls.members.items(), key=lambda item: lines.get(item[0], math.inf))
        cls.members.clear()
        cls.members.update(ordered)
