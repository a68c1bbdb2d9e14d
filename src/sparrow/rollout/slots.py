"""Which of an engine's slots are free, and what the host knows of the held ones.

A *generation slot* (a row of :class:`~sparrow.rollout.state.RowState`) holds one sample while it decodes; a
*prefix slot* holds one prompt's KV, read by the rows of its group (every row its own, without prefix sharing). One
:class:`SlotTable` per engine: sessions admit groups into it and release their rows, the engine reads each held
row's prefix slot and its length as of the last block.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class SlotTable:
    """The free generation and prefix slots of an engine (lowest first), the prefix slot each held row reads, how
    many held rows read each prefix slot, and each held row's length as of the last host read.

    Args:
        num_rows: generation slots.
        num_prefixes: prefix slots.

    Raises:
        ValueError: a count below 1.
    """

    def __init__(self, num_rows: int, num_prefixes: int) -> None:
        if num_rows < 1 or num_prefixes < 1:
            raise ValueError(f"a slot table needs at least one slot of each kind, got {num_rows}, {num_prefixes}")
        self._free_rows = list(range(num_rows))  # ascending
        self._free_prefixes = list(range(num_prefixes))  # ascending
        self._prefix: dict[int, int] = {}  # held row -> its prefix slot
        self._readers: dict[int, int] = {}  # held prefix slot -> held rows reading it
        self._length: dict[int, int] = {}  # held row -> tokens emitted, as of the last host read

    @property
    def free_rows(self) -> list[int]:
        """Generation slots no one holds, ascending (a copy)."""
        return list(self._free_rows)

    @property
    def free_prefixes(self) -> list[int]:
        """Prefix slots no one holds, ascending (a copy)."""
        return list(self._free_prefixes)

    def fits(self, rows: int, prefixes: int) -> bool:
        """Whether ``rows`` generation slots and ``prefixes`` prefix slots are free."""
        return len(self._free_rows) >= rows and len(self._free_prefixes) >= prefixes

    def admit(self, rows: int, prefixes: int) -> tuple[list[int], list[int]]:
        """Take the lowest ``rows`` free generation slots and ``prefixes`` free prefix slots for one group: row ``j``
        reads prefix ``j % prefixes``. Returns (rows, prefix slots).

        Raises:
            ValueError: not enough free slots (see :meth:`fits`), or ``prefixes`` not in ``1..rows``.
        """
        if not 1 <= prefixes <= rows or not self.fits(rows, prefixes):
            raise ValueError(f"cannot admit {rows} rows over {prefixes} prefix slots: {len(self._free_rows)} and "
                             f"{len(self._free_prefixes)} are free")
        taken = [self._free_rows.pop(0) for _ in range(rows)]
        slots = [self._free_prefixes.pop(0) for _ in range(prefixes)]
        for j, r in enumerate(taken):
            slot = slots[j % prefixes]
            self._prefix[r] = slot
            self._readers[slot] = self._readers.get(slot, 0) + 1
        return taken, slots

    def prefix_of(self, row: int) -> int:
        """The prefix slot held row ``row`` reads (KeyError for a free row)."""
        return self._prefix[row]

    def length(self, row: int) -> int:
        """Tokens held row ``row`` has emitted, as of the last host read (1, its first token, before any)."""
        return self._length.get(row, 1)

    def record_lengths(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """The lengths of ``rows`` as a block's host read found them (a finished row's stays until its release)."""
        self._length.update(zip(rows, lengths))

    def release(self, rows: Iterable[int]) -> None:
        """Give held ``rows`` back, and with them every prefix slot no held row reads anymore."""
        for r in rows:
            slot = self._prefix.pop(r)
            self._length.pop(r, None)
            self._free_rows.append(r)
            self._readers[slot] -= 1
            if self._readers[slot] == 0:
                del self._readers[slot]
                self._free_prefixes.append(slot)
        self._free_rows.sort()
        self._free_prefixes.sort()
