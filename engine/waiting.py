"""The scheduler's queue of waiting sequences, indexed by rid: removing any one of them costs O(1).

A ``deque`` kept the order but removing an aborted sequence scanned it, so a client that went away
with thousands of queued sequences cost the scheduler thread a quadratic stall. An insertion-ordered
dict keeps the same order (``popleft``, ``appendleft`` to put a sequence back at the head) and
removes by key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from rollout_bus.engine.sequence import Seq


class WaitQueue:
    def __init__(self) -> None:
        self._seqs: OrderedDict[str, Seq] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Seq]:
        return iter(list(self._seqs.values()))

    def __contains__(self, seq: Seq) -> bool:
        return self._seqs.get(seq.rid) is seq

    def append(self, seq: Seq) -> None:
        self._seqs[seq.rid] = seq

    def appendleft(self, seq: Seq) -> None:
        self._seqs[seq.rid] = seq
        self._seqs.move_to_end(seq.rid, last=False)

    def extendleft(self, seqs: Iterable[Seq]) -> None:
        """Put ``seqs`` back at the head, in their order (unlike ``deque.extendleft``)."""
        for seq in reversed(list(seqs)):
            self.appendleft(seq)

    def popleft(self) -> Seq:
        return self._seqs.popitem(last=False)[1]

    def remove(self, seq: Seq) -> None:
        """Drop ``seq``; ``KeyError`` if it is not waiting here."""
        if self._seqs.get(seq.rid) is not seq:
            raise KeyError(seq.rid)
        del self._seqs[seq.rid]
