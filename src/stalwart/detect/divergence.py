"""Replica divergence: data-parallel replicas must hold bitwise the same replicated state; a periodic fingerprint
finds the one that does not, and the replicas that agree repair it.

Why: silent data corruption (a flipped bit in memory, a miscomputing core) changes one replica's parameters or
optimizer state without any error. Data parallelism does not notice: it keeps averaging gradients, the replicas
drift apart, and every checkpoint (each replicated tensor written once, by one rank) mixes them.

How: every `every` steps each rank fingerprints its replicated objects' tensors: per tensor, the sum of its
bytes read as 64-bit integers, wrapping (an integer sum does not depend on the order of additions, so every rank
and device gets the same one), with the bytes past the last whole word summed as 8-bit integers; one read of the
tensor, one host transfer per device; then all of them hashed in order into 63 bits. Summing 32-bit words into
64 bits, as before, was twenty times slower (torch widens every word first; docs/benchmarks.md).
One all-gather compares the ranks. All equal: nothing happens. Otherwise a `replica_divergence` event names
the ranks outside the largest group of equal fingerprints:

- with a strict majority (three or more replicas), the odd ranks are repaired in place: every replicated
  tensor is broadcast from the lowest rank of the majority, so all replicas hold the majority's state again
  (`replicas_repaired`); training goes on without a restart;
- without one (two replicas, or a tie), nobody can tell which is right: the job rolls back (L0,
  recovery/rollback.py) to the newest snapshot or checkpoint from at or before the last step the replicas agreed
  on, and replays from there; if it holds none, it stops with ReplicaDivergenceError (one line, not retried)
  naming that step, whose checkpoint is the one to resume from.

A sum of words detects any single flipped bit and almost every other change (two changes that cancel exactly
are not detected); it is a fingerprint for corruption, not a cryptographic hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from stalwart.errors import ReplicaDivergenceError
from stalwart.telemetry.events import EventLog

MASK = (1 << 63) - 1


def fingerprint(tensors: Iterable[torch.Tensor]) -> int:
    """A 63-bit fingerprint of the tensors' bytes, in order (see the module docstring)."""
    sums: dict[torch.device, list[torch.Tensor]] = {}
    order: list[tuple[torch.device, int]] = []
    for t in tensors:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        flat = t.reshape(-1)
        if flat.numel() == 0:
            continue
        raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
        if raw.storage_offset() % 8:  # a view starting mid-word (a slice of a larger tensor): words from its start
            raw = raw.clone()
        whole = raw.numel() // 8 * 8
        total = raw[:whole].view(torch.int64).sum()  # wraps: the same sum in any order
        if whole < raw.numel():
            total = total + raw[whole:].sum(dtype=torch.int64)
        per = sums.setdefault(t.device, [])
        order.append((t.device, len(per)))
        per.append(total)
    values = {d: torch.stack(v).cpu().tolist() for d, v in sums.items()}
    digest = hashlib.blake2b(digest_size=8)
    for device, i in order:
        digest.update(struct.pack("<q", values[device][i]))
    return int.from_bytes(digest.digest(), "little") & MASK


def odd_ranks(prints: list[int]) -> tuple[list[int], int | None]:
    """(ranks outside the largest group of equal fingerprints, a rank of that group if it is a strict
    majority, else None)."""
    counts = Counter(prints)
    (common, n), *rest = counts.most_common()
    majority = n * 2 > len(prints) and not (rest and rest[0][1] == n)
    odd = [r for r, p in enumerate(prints) if p != common] if majority else list(range(len(prints)))
    return odd, (prints.index(common) if majority else None)


class DivergenceCheck:
    """Compares the replicas' fingerprints every `every` steps and repairs or stops (module docstring)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        events: EventLog,
        tensors: Callable[[], list[torch.Tensor]],
        gather: Callable[[list[int]], list[list[int]]],
        broadcast: Callable[[torch.Tensor, int], None],
        every: int,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._events = events
        self._tensors = tensors
        self._gather = gather
        self._broadcast = broadcast
        self.every = every
        self.last_agreed: int | None = None
        self.repairs = 0

    def due(self, step: int) -> bool:
        return self.world_size > 1 and step % self.every == 0

    def check(self, step: int, on_odd: Callable[[], None] | None = None) -> bool:
        """At `step` (every rank): compare; repair the odd replicas if a majority agrees. Whether all agreed.
        `on_odd` runs as soon as the replicas are known to differ, before any repair or error."""
        tensors = self._tensors()
        prints = [g[0] for g in self._gather([fingerprint(tensors)])]
        if len(set(prints)) == 1:
            self.last_agreed = step
            return True
        if on_odd is not None:
            on_odd()
        odd, good = odd_ranks(prints)
        self._events.emit(
            "replica_divergence",
            step=step,
            odd=odd,
            fingerprints=[str(p) for p in prints],
            last_agreed=self.last_agreed,
            repair_from=good,
        )
        if good is None:
            since = f"step {self.last_agreed}" if self.last_agreed is not None else "no checked step"
            raise ReplicaDivergenceError(
                f"the replicas' state differs at step {step} (fingerprints of ranks {odd}) and no majority can say "
                f"which is right; they last agreed at {since}: resume from the newest checkpoint at or before it",
                quiet=self.rank != 0,
                last_agreed=self.last_agreed,
            )
        with torch.no_grad():
            for t in tensors:
                if t.is_contiguous():
                    self._broadcast(t.detach(), good)
                else:  # collectives take contiguous tensors
                    staged = t.detach().contiguous()
                    self._broadcast(staged, good)
                    t.detach().copy_(staged)
        self.repairs += 1
        self._events.emit("replicas_repaired", step=step, odd=odd, source=good, tensors=len(tensors))
        self.last_agreed = step
        return False


def broadcast_on_default_group(tensor: torch.Tensor, src: int) -> None:
    """Broadcast in place on the default process group (the one the replicas train on: gloo or NCCL)."""
    dist.broadcast(tensor, src=src)
