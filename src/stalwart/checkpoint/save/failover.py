"""Saves that go on while the checkpoint directory is down: a full checkpoint written to a mirror instead (issue 46).

Why: with the primary store down (an outage, its region lost), every save would retry there until its deadline and
be given up, and no checkpoint would be made for as long as the outage lasts. With mirrors, each rank's persister
tries the checkpoint directory for `failover_s` (20 s by default), then the first mirror, then the next; the last
location it tries gets what is left of the save's deadline. Rank 0 commits the checkpoint where every rank's shard
is: a checkpoint counts as durable once one location committed it. Rank 0's persister then copies it to every other
location (mirroring.py), the checkpoint directory among them, which is caught up when it answers; a start chooses
among all the locations (load/newest.py).

Every rank follows the same rule against the same stores, so in an outage they land in the same place. Where they
do not (rank 0 finished on the primary just before the outage, the others wrote to a mirror after it), rank 0
writes its own shard again where the others' are, from the staging memory this save still holds. Shards split
between places rank 0 cannot join are given up, as a save that fails is: the previous checkpoint stays the newest.

A delta checkpoint (`full_every` > 1) does not fail over: its base's files may not be in the other location.
Imports no torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from stalwart.checkpoint.save.request import PersistRequest


@dataclass(frozen=True, slots=True)
class Location:
    """A place a save may be written: its URL and fsspec options, and its index (0: the checkpoint directory)."""

    index: int
    url: str
    options: dict[str, Any] | None

    @property
    def spec(self) -> dict[str, Any]:
        """As mirroring.py takes a location."""
        return {"url": self.url, "options": self.options}


def locations(req: PersistRequest) -> list[Location]:
    """Where this save may be written, in the order to try: the checkpoint directory, then (for a full checkpoint)
    each mirror."""
    primary = Location(0, req.url, req.options)
    if req.base is not None:
        return [primary]
    return [primary, *(Location(i + 1, m["url"], m.get("options")) for i, m in enumerate(req.mirrors))]


def others(req: PersistRequest, committed_url: str) -> list[dict[str, Any]]:
    """Every location but the one a checkpoint was committed in (the checkpoint directory first): where rank 0's
    persister copies it (mirroring.py)."""
    every = [{"url": req.url, "options": req.options}, *req.mirrors]
    return [{"url": m["url"], "options": m.get("options")} for m in every if m["url"] != committed_url]


def one_place(listings: dict[int, set[str]], wanted: set[str], own: int) -> int | None:
    """Where rank 0 can commit: its own location `own` when every other rank's meta file (`wanted`) is listed
    there, else the first location where they all are; None while there is none. `listings` maps a location's
    index to the names in its step directory."""
    if wanted <= listings.get(own, set()):
        return own
    return next((index for index in sorted(listings) if wanted <= listings[index]), None)


def split(listings: dict[int, set[str]], wanted: set[str]) -> str | None:
    """Which meta files are where, when every one is listed somewhere but no location has them all (rank 0 cannot
    make one whole); None otherwise."""
    found = set().union(*listings.values()) & wanted
    if found != wanted or one_place(listings, wanted, 0) is not None:
        return None
    return "; ".join(f"{sorted(names & wanted)} in location {index}" for index, names in sorted(listings.items()))


_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def location_lock(where: str) -> threading.Lock:
    """The lock rank 0's persister holds on a location (by its display name) while it prunes there or copies a step
    there: retention takes a step directory without a manifest older than the newest commit for an interrupted
    save, which a copy of an older step into a location that committed newer ones is, until its manifest lands."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(where, threading.Lock())
