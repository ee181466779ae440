"""HGMem's two graphs (Zhou et al., arXiv 2512.23959, ICML 2026; code Encyclomen/HGMem).

:class:`KnowledgeGraph` — the offline graph built from the document: vertices are entities (name, type,
description, the chunks that mention them), edges are relations between two entities (description, chunks).
``neighbourhood(names, hops)`` is the BFS ball of radius ``hops`` (HGMem's local investigation: 2 hops).

:class:`HypergraphMemory` — the working memory. Its vertices are entity names; its **hyperedges are memory
points** ``(involved_objects ⊆ V, description)`` (the paper asks ``|objects| ≥ 2``; a point about one entity
is kept too, as the official post-processing does). Operations, each keeping the incidence
``vertex -> {point ids}`` equal to the transpose of ``point -> objects``:

- :meth:`insert` a new point; :meth:`update` rewrite point ``i`` (description, optionally objects);
- :meth:`merge` points ``(i, j, ...)`` into one higher-order hyperedge: objects = union, a new description,
  chunks = union; the merged points are removed.

:meth:`HypergraphMemory.check` verifies the invariant (tests call it after every operation).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import LonglabError, shorten

__all__ = [
    "Entity",
    "Relation",
    "KnowledgeGraph",
    "MemoryPoint",
    "HypergraphMemory",
    "norm_name",
    "MAX_POINTS",
]

MAX_POINTS = 10_000


def norm_name(name: str) -> str:
    """Entity names are compared upper-cased with collapsed whitespace (as the official code)."""
    return " ".join(str(name).replace('"', "").split()).upper()


@dataclass
class Entity:
    name: str
    type: str = ""
    description: str = ""
    chunks: set[int] = field(default_factory=set)


@dataclass
class Relation:
    source: str
    target: str
    description: str = ""
    chunks: set[int] = field(default_factory=set)


class KnowledgeGraph:
    """Entities and undirected relations, with the chunks each was extracted from."""

    def __init__(self) -> None:
        self.entities: dict[str, Entity] = {}
        self.relations: dict[tuple[str, str], Relation] = {}
        self.adj: dict[str, set[str]] = {}

    def add_entity(self, name: str, type: str = "", description: str = "", chunk: int | None = None) -> str:
        """Add or extend entity ``name`` (descriptions of repeats are joined); its normalised name."""
        key = norm_name(name)
        if not key:
            raise LonglabError(f"an entity name must be non-empty, got {shorten(name)}")
        ent = self.entities.get(key)
        if ent is None:
            ent = self.entities[key] = Entity(key, str(type).lower())
            self.adj.setdefault(key, set())
        if description and description not in ent.description:
            ent.description = (ent.description + " " + description).strip()
        if chunk is not None:
            ent.chunks.add(chunk)
        return key

    def add_relation(self, source: str, target: str, description: str = "", chunk: int | None = None) -> None:
        """Add or extend the relation between two entities (created if absent); a self-loop is ignored."""
        a, b = self.add_entity(source, chunk=chunk), self.add_entity(target, chunk=chunk)
        if a == b:
            return
        key = (a, b) if a < b else (b, a)
        rel = self.relations.get(key)
        if rel is None:
            rel = self.relations[key] = Relation(key[0], key[1])
        if description and description not in rel.description:
            rel.description = (rel.description + " " + description).strip()
        if chunk is not None:
            rel.chunks.add(chunk)
        self.adj[a].add(b)
        self.adj[b].add(a)

    def neighbourhood(self, names: Iterable[str], hops: int = 2) -> list[str]:
        """Entities within ``hops`` edges of ``names`` (BFS order: the names first, then by distance)."""
        seen: dict[str, int] = {}
        queue: deque[str] = deque()
        for n in names:
            key = norm_name(n)
            if key in self.entities and key not in seen:
                seen[key] = 0
                queue.append(key)
        while queue:
            cur = queue.popleft()
            if seen[cur] >= hops:
                continue
            for nxt in sorted(self.adj.get(cur, ())):
                if nxt not in seen:
                    seen[nxt] = seen[cur] + 1
                    queue.append(nxt)
        return list(seen)

    def relations_among(self, names: Iterable[str]) -> list[Relation]:
        keep = set(names)
        return [r for k, r in self.relations.items() if k[0] in keep and k[1] in keep]


@dataclass
class MemoryPoint:
    """One hyperedge: the entities it involves, what the model concluded, and its supporting chunks."""

    id: int
    objects: frozenset[str]
    description: str
    chunks: frozenset[int] = frozenset()


class HypergraphMemory:
    """Memory points over entity vertices, with a consistent incidence map."""

    def __init__(self, max_points: int = 256) -> None:
        if not 1 <= max_points <= MAX_POINTS:
            raise LonglabError(
                f"max_points must be an integer in [1, {MAX_POINTS}], got {shorten(max_points)}"
            )
        self.max_points = max_points
        self.points: dict[int, MemoryPoint] = {}
        self.incidence: dict[str, set[int]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self.points)

    def _attach(self, point: MemoryPoint) -> None:
        self.points[point.id] = point
        for v in point.objects:
            self.incidence.setdefault(v, set()).add(point.id)

    def _detach(self, pid: int) -> MemoryPoint:
        point = self.points.pop(pid)
        for v in point.objects:
            ids = self.incidence[v]
            ids.discard(pid)
            if not ids:
                del self.incidence[v]
        return point

    @staticmethod
    def _objects(objects: Iterable[str]) -> frozenset[str]:
        objs = frozenset(k for k in (norm_name(o) for o in objects) if k)
        if not objs:
            raise LonglabError("a memory point needs at least one involved object (entity name)")
        return objs

    def insert(self, objects: Iterable[str], description: str, chunks: Iterable[int] = ()) -> int:
        """Add a hyperedge; its id. An identical (objects, description) point is not duplicated."""
        objs = self._objects(objects)
        description = str(description).strip()
        for p in self.points.values():
            if p.objects == objs and p.description == description:
                return p.id
        if len(self.points) >= self.max_points:
            raise LonglabError(f"memory is full: max_points={self.max_points}")
        pid = self._next
        self._next += 1
        self._attach(MemoryPoint(pid, objs, description, frozenset(chunks)))
        return pid

    def update(
        self, pid: int, description: str, objects: Iterable[str] | None = None, chunks: Iterable[int] = ()
    ) -> None:
        """Rewrite point ``pid``'s description (and objects, when given); chunks are added."""
        if pid not in self.points:
            raise LonglabError(f"no memory point {shorten(pid)}; ids: {sorted(self.points)}")
        old = self._detach(pid)
        objs = old.objects if objects is None else self._objects(objects)
        self._attach(MemoryPoint(pid, objs, str(description).strip(), old.chunks | frozenset(chunks)))

    def merge(self, pids: Iterable[int], description: str) -> int:
        """Replace points ``pids`` (≥ 2 distinct) by one hyperedge over the union of their objects and
        chunks, with ``description``; the new id."""
        ids = list(dict.fromkeys(pids))
        missing = [i for i in ids if i not in self.points]
        if len(ids) < 2 or missing:
            raise LonglabError(
                f"merge needs at least two existing memory point ids, got {shorten(ids)} "
                f"(ids: {sorted(self.points)})"
            )
        olds = [self._detach(i) for i in ids]
        pid = self._next
        self._next += 1
        objs = frozenset().union(*(p.objects for p in olds))
        chunks = frozenset().union(*(p.chunks for p in olds))
        self._attach(MemoryPoint(pid, objs, str(description).strip(), chunks))
        return pid

    def points_of(self, vertex: str) -> set[int]:
        return set(self.incidence.get(norm_name(vertex), ()))

    def vertices(self) -> set[str]:
        return set(self.incidence)

    def check(self) -> None:
        """Raise ``AssertionError`` unless ``incidence`` is exactly the transpose of the points' objects."""
        expect: dict[str, set[int]] = {}
        for pid, p in self.points.items():
            assert p.id == pid, f"point {pid} stored under another id {p.id}"
            assert p.objects, f"point {pid} has no objects"
            for v in p.objects:
                expect.setdefault(v, set()).add(pid)
        assert expect == self.incidence, "incidence differs from the points' objects"

    def render(self, ids: Iterable[int] | None = None) -> str:
        """The points as numbered lines ``[i] (A, B): description``."""
        chosen = sorted(self.points) if ids is None else [i for i in ids if i in self.points]
        return (
            "\n".join(
                f"[{i}] ({', '.join(sorted(self.points[i].objects))}): {self.points[i].description}"
                for i in chosen
            )
            or "(empty)"
        )
