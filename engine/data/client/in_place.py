"""`InPlaceReader`: a same-host ref read straight from its owner's segment, no request sent.

It owns the set of owners whose segments this process turned out unable to map; the
`SegmentMapper` it reads through is the client's, shared with both of its paths.
"""

from __future__ import annotations

import time

from engine.data.codec import TensorData, WireError, check_header, contiguous_strides
from engine.data.shm import SegmentError, SegmentMapper, parse_segment_name
from engine.data.wire import TensorHeader, TensorRef, Transport


class InPlaceReader:
    """Thread-safe: the mapper is, and `_refused` only grows (a set add under the GIL)."""

    def __init__(self, host: str, mapper: SegmentMapper) -> None:
        self.host = host
        self._mapper = mapper
        self._refused: set[str] = set()  # owners whose segments this process cannot map

    def read(self, ref: TensorRef, transports: tuple[Transport, ...]) -> TensorData | None:
        """The tensor straight from the owner's segment, without a round trip, when the ref says
        where it is, its lease runs and the segment still holds it (its generation word matches);
        None otherwise, and the owner is asked instead."""
        location = ref.shm
        if (
            location is None
            or Transport.SHM not in transports
            or ref.host != self.host
            or ref.owner in self._refused
            or ref.lease_expires_at <= time.time()
            or location.offset < 8
            or location.offset + ref.nbytes > location.size
        ):
            return None
        owner = parse_segment_name(location.segment)
        if owner is None or not owner.alive():
            return None  # a dead owner is an error, which the owner's silence will tell
        try:
            mapping = self._mapper.map(location.segment, location.size)
        except (SegmentError, OSError):
            self._refused.add(ref.owner)  # not our /dev/shm after all: the owner decides
            return None
        if int.from_bytes(mapping[:8], "little") != location.generation:
            return None  # released, maybe recycled: only the owner can tell
        header = TensorHeader(ref.dtype, ref.shape, contiguous_strides(ref.shape), ref.nbytes, location.offset)
        try:
            check_header(header)
        except WireError:
            return None
        return TensorData(header, mapping, Transport.SHM)
