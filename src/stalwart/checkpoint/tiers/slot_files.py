"""A rank's slot files in the node's shared-memory directory, and the images of whole slots that peer replicas
(L3, checkpoint/tiers/replicas.py) send to other nodes and keep for them.

Each rank has two slots for full snapshots, two for light ones (checkpoint/tiers/memory.py writes the older of a
pair), and two ward slots per replica it keeps for a rank of another node. An image is a slot's whole file
(header, table of contents, data): it travels as bytes and is written into a slot header last.
"""

from __future__ import annotations

from pathlib import Path

from stalwart.checkpoint.tiers.slot import Slot, SlotHeader, read_image, whole_image, write_image


class SlotFiles:
    """This rank's own slots and its ward slots; the base of MemoryReader and so of MemoryTier."""

    def __init__(self, directory: Path, rank: int, world_size: int, local_rank: int, kind: str = "slot") -> None:
        """`kind`: the full snapshots' file kind; "stretch" for the images FSDP2 survivors leave for the whole job
        at a grow (recovery/in_loop/sharded_stretch.py), which no other restore reads."""
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self._slots = [Slot(self._slot_path(local_rank, i, kind)) for i in (0, 1)]
        self._light = [Slot(self._slot_path(local_rank, i, "light")) for i in (0, 1)]

    def _slot_path(self, local_rank: int, index: int, kind: str = "slot") -> Path:
        # kind: slot, light, and ward<k>.slot, ward<k>.light for the images kept for another node's rank (L3)
        return self.directory / f"local{local_rank:05d}.{kind}{index}"

    def _own(self, header: SlotHeader | None, step: int) -> bool:
        """Whether a slot's header is a whole snapshot of `step` by this rank at this world size: a rank of
        another world size's run may have left the same file name behind."""
        return header is not None and (header.step, header.rank, header.world_size) == (
            step,
            self.rank,
            self.world_size,
        )

    @staticmethod
    def _older(slots: list[Slot]) -> Slot:
        headers = [s.header() for s in slots]
        steps = [h.step if h is not None else -1 for h in headers]
        return slots[0] if steps[0] <= steps[1] else slots[1]

    def image(self, step: int, *, light: bool) -> bytes:
        """This rank's full (or light) snapshot of `step` as one slot image (header, table of contents, data),
        to keep on another node; empty if no slot holds it whole."""
        for slot in self._light if light else self._slots:
            h = slot.header()
            if self._own(h, step):
                assert h is not None
                return read_image(slot.path, h)
        return b""

    def _ward_slots(self, replica: int, light: bool) -> list[Slot]:
        return [
            Slot(self._slot_path(self.local_rank, i, f"ward{replica}.{'light' if light else 'slot'}")) for i in (0, 1)
        ]

    def store_ward(self, replica: int, image: bytes, *, light: bool) -> bool:
        """Keep another rank's slot image (from `image`) in the older of this rank's two ward slots of
        `replica`; False (nothing written) if it is not a whole image of this world size."""
        if not whole_image(image, self.world_size):
            return False
        target = self._older(self._ward_slots(replica, light))
        try:
            write_image(target, image)
        finally:
            target.close()
        return True

    def held(self, replicas: int) -> list[tuple[int, bool, int, int]]:
        """Every whole image of this world size in this rank's slots, its own and the ward slots of `replicas`
        replicas: (source, light, rank, step). A source is a slot's number for `held_image`."""
        found = []
        for source, (slot, light) in enumerate(self._all_slots(replicas)):
            h = slot.header()
            if h is not None and h.world_size == self.world_size:
                found.append((source, light, h.rank, h.step))
        return found

    def held_image(self, replicas: int, source: int) -> bytes:
        """The image in slot `source` of `held`; empty if it is no longer whole."""
        slot = self._all_slots(replicas)[source][0]
        h = slot.header()
        return read_image(slot.path, h) if h is not None else b""

    def _all_slots(self, replicas: int) -> list[tuple[Slot, bool]]:
        found = [(s, False) for s in self._slots] + [(s, True) for s in self._light]
        for replica in range(replicas):
            for light in (False, True):
                found += [(s, light) for s in self._ward_slots(replica, light)]
        return found
