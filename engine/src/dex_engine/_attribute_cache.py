"""Attribute rows a process already read or wrote, by flow, valid while the flow's version holds.

Every change to a flow's attributes bumps its row's `version` in the same transaction (history or
`bump`), so the rows a transaction of this process saw at a version are the rows any later
transaction sees while the flow is still at that version. A Step that loads the rows its flow had
at the end of the last commit (an agent turn's message window, loaded by three Steps a turn) then
reads them from here instead of the database: the transaction reads the flow row anyway (its lease
check, the RPC's flow check) and compares the version and the flow's creation time.

Entries are written only after the transaction that produced them committed (a rolled-back one
changes nothing), and only by the store's own connection, whose transactions are serialized; any
other connection's commit bumps the version and so makes them stale, never wrong.

Inside one store operation the rows are tracked by `KnownRows`, which the operation's own writes
update; `_transitions` keeps one per flow whose version the operation read.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ._limits import ATTRIBUTE_CACHE_BYTES, ATTRIBUTE_CACHE_FLOWS
from ._options import LoadSpec

Ident = tuple[str, str]  # (name, key); key '' for a plain attribute


@dataclass
class KnownRows:
    """A flow's attribute rows as the database holds them at `version` (plus, inside an operation,
    that operation's own writes): every instance of each name in `whole`, or of every name when
    `every`. Other names are not known, even those with rows here."""

    version: int
    created_at: int
    rows: dict[Ident, bytes] = field(default_factory=dict)
    whole: set[str] = field(default_factory=set)
    every: bool = False
    # Every name that may have a row here (a name stays after its last row goes): a load naming all
    # of them takes the rows in one copy, not a test per row (a turn's model call loads nearly all).
    named: set[str] = field(default_factory=set)

    def copy(self) -> KnownRows:
        return KnownRows(self.version, self.created_at, dict(self.rows), set(self.whole), self.every, set(self.named))

    def covers(self, name: str) -> bool:
        return self.every or name in self.whole

    def split(self, spec: LoadSpec) -> tuple[dict[Ident, bytes], LoadSpec | None]:
        """The rows of `spec` known here, and what is left to read (None: nothing)."""
        if spec.mode == "none":
            return {}, None
        if spec.mode == "all":
            return (dict(self.rows), None) if self.every else ({}, spec)
        every, whole = self.every, self.whole
        names: set[str] = set()
        rest_names: list[str] = []
        if every or whole.issuperset(spec.names):
            names.update(spec.names)
        else:
            for name in spec.names:
                if name in whole:
                    names.add(name)
                else:
                    rest_names.append(name)
        instances: list[Ident] = []
        rest_instances: list[Ident] = []
        for ident in spec.instances:
            (instances if every or ident[0] in whole else rest_instances).append(ident)
        rest = LoadSpec("only", tuple(rest_names), tuple(rest_instances)) if rest_names or rest_instances else None
        if not names and not instances:
            return {}, rest
        if self.named <= names:
            found = dict(self.rows)
        else:
            found = {ident: value for ident, value in self.rows.items() if ident[0] in names}
        for ident in instances:
            value = self.rows.get(ident)
            if value is not None:
                found[ident] = value
        return found, rest

    def learn(self, spec: LoadSpec, rows: dict[Ident, bytes]) -> None:
        """Record the rows a load of `spec` read from the database (whole names only)."""
        if spec.mode == "all":
            self.rows, self.every = dict(rows), True
            self.named = {name for name, _key in rows}
            return
        if spec.mode == "none" or not spec.names:
            return
        names = set(spec.names)
        for ident in [i for i in self.rows if i[0] in names]:
            del self.rows[ident]
        for ident, value in rows.items():
            if ident[0] in names:
                self.rows[ident] = value
                self.named.add(ident[0])
        self.whole |= names

    def apply(self, writes: dict[Ident, bytes | None]) -> None:
        """This operation's writes (None deletes), to the names known whole."""
        rows, whole, every, named = self.rows, self.whole, self.every, self.named
        for ident, value in writes.items():
            if every or ident[0] in whole:
                if value is None:
                    rows.pop(ident, None)
                else:
                    rows[ident] = value
                    named.add(ident[0])

    @property
    def size(self) -> int:
        return sum(map(len, self.rows.values()))


class AttributeCache:
    """Committed KnownRows by flow, newest use last; at most ATTRIBUTE_CACHE_FLOWS flows and
    ATTRIBUTE_CACHE_BYTES of values. Used under the store's connection lock only."""

    def __init__(self, max_flows: int = ATTRIBUTE_CACHE_FLOWS, max_bytes: int = ATTRIBUTE_CACHE_BYTES) -> None:
        self._entries: OrderedDict[str, tuple[KnownRows, int]] = OrderedDict()
        self._bytes = 0
        self._max_flows = max_flows
        self._max_bytes = max_bytes

    def get(self, flow_id: str, version: int, created_at: int) -> KnownRows | None:
        """The flow's rows when they are those of `version` (and of this incarnation of the flow)."""
        entry = self._entries.get(flow_id)
        if entry is None:
            return None
        known = entry[0]
        if known.version != version or known.created_at != created_at:
            return None
        self._entries.move_to_end(flow_id)
        return known

    def put(self, flow_id: str, known: KnownRows) -> None:
        self.drop(flow_id)
        size = known.size
        if size > self._max_bytes:
            return
        self._entries[flow_id] = (known, size)
        self._bytes += size
        while len(self._entries) > self._max_flows or self._bytes > self._max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped

    def drop(self, flow_id: str) -> None:
        entry = self._entries.pop(flow_id, None)
        if entry is not None:
            self._bytes -= entry[1]

    def __len__(self) -> int:
        return len(self._entries)
