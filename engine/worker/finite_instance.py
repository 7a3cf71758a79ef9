"""Whether a JSON schema has an instance of finite size.

A schema whose every instance must contain another instance of itself has none: a ``$defs``
entry that is only its own ``$ref``, or an object that requires a property of its own type.
llguidance compiles such a schema, and a generation under it could never close its JSON (or
ends at once, with no JSON at all), so admission refuses it.

The check is conservative: it follows only what every instance must contain (a ``$ref``, each
``allOf`` member, some ``anyOf``/``oneOf`` branch, the required properties of a schema that is
only an object, the first ``minItems`` items of one that is only an array), and refuses a
schema only when none of its instances can be finite. Anything else (an unknown keyword, a ref
it cannot resolve) counts as satisfiable and is left to llguidance.

Every schema becomes an AND node (all its children must be finite) or an OR node (one must),
and finiteness spreads from the leaves, as in finding a grammar's productive symbols: linear in
the schema's size, cycles included.
"""

from __future__ import annotations

import json
from collections import deque
from urllib.parse import unquote


def has_finite_instance(schema_text: str) -> bool:
    """False only when no instance of the JSON schema ``schema_text`` is finite. Without a
    ``$ref`` nothing in it recurs: it is left to llguidance, which refuses what it cannot
    satisfy."""
    if '"$ref"' not in schema_text:
        return True
    try:
        schema = json.loads(schema_text)
        graph = _Graph(schema)
        root = graph.node(schema)
    except (ValueError, RecursionError):  # not for this check to judge: llguidance will
        return True
    return graph.finite(root)


class _Graph:
    def __init__(self, root: object):
        self.root = root
        self.any_of: list[bool] = []  # per node: OR (else AND)
        self.children: list[list[int]] = []
        self.ids: dict[int, int] = {}  # id(schema dict) -> node; the root keeps them alive

    def _new(self, any_of: bool) -> int:
        self.any_of.append(any_of)
        self.children.append([])
        return len(self.children) - 1

    def node(self, schema: object) -> int:
        if schema is False:
            return self._new(any_of=True)  # no child: no instance at all
        if not isinstance(schema, dict):
            return self._new(any_of=False)  # true, or not a schema: satisfiable
        if id(schema) in self.ids:
            return self.ids[id(schema)]
        n = self.ids[id(schema)] = self._new(any_of=False)
        must = self.children[n]
        ref = schema.get("$ref")
        if isinstance(ref, str) and (target := self._resolve(ref)) is not None:
            must.append(self.node(target))
        for member in _list(schema.get("allOf")):
            must.append(self.node(member))
        for key in ("anyOf", "oneOf"):
            if branches := _list(schema.get(key)):
                either = self._new(any_of=True)
                self.children[either] = [self.node(b) for b in branches]
                must.append(either)
        kind = schema.get("type")
        if kind in ("object", ["object"]):
            properties = schema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            for name in _list(schema.get("required")):
                if isinstance(name, str) and name in properties:
                    must.append(self.node(properties[name]))
        if kind in ("array", ["array"]):
            must += [self.node(item) for item in self._first_items(schema)]
        return n

    @staticmethod
    def _first_items(schema: dict) -> list[object]:
        """The item schemas of an array's first ``minItems`` items."""
        count = schema.get("minItems", 0)
        if not isinstance(count, int) or count <= 0:
            return []
        items = schema.get("items")
        prefix = _list(schema.get("prefixItems")) or _list(items)
        first = prefix[:count]
        if count > len(prefix):
            rest = schema.get("additionalItems") if isinstance(items, list) else items
            if isinstance(rest, dict | bool):
                first.append(rest)
        return first

    def _resolve(self, ref: str) -> object | None:
        """The schema a local JSON-pointer ``$ref`` names, or None."""
        if not ref.startswith("#") or (ref != "#" and not ref.startswith("#/")):
            return None
        at = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(at, dict) and part in at:
                at = at[part]
            elif isinstance(at, list) and part.isdigit() and int(part) < len(at):
                at = at[int(part)]
            else:
                return None
        return at

    def finite(self, root: int) -> bool:
        """Whether node ``root`` can be finite: spread from the AND nodes without children."""
        waiting = [len(c) for c in self.children]
        parents: list[list[int]] = [[] for _ in self.children]
        for n, children in enumerate(self.children):
            for c in children:
                parents[c].append(n)
        done = [False] * len(self.children)
        todo = deque(n for n, c in enumerate(self.children) if not c and not self.any_of[n])
        for n in todo:
            done[n] = True
        while todo:
            for p in parents[todo.popleft()]:
                waiting[p] -= 1
                if not done[p] and (self.any_of[p] or waiting[p] == 0):
                    done[p] = True
                    todo.append(p)
        return done[root]


def _list(value: object) -> list:
    return value if isinstance(value, list) else []
