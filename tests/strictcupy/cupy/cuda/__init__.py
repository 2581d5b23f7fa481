"""``cupy.cuda`` of the strict stand-in: devices, streams, events, pinned memory."""

from __future__ import annotations

from .._core import (  # noqa: F401
    Device,
    Event,
    PinnedMemoryPointer,
    Stream,
    alloc_pinned_memory,
    get_current_stream,
    get_elapsed_time,
)
from . import runtime


def is_available() -> bool:
    return runtime.getDeviceCount() > 0


class MemoryPool:
    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        pass


class PinnedMemoryPool(MemoryPool):
    def n_free_blocks(self) -> int:
        return 0


def set_pinned_memory_allocator(allocator=None) -> None:
    pass


def set_allocator(allocator=None) -> None:
    pass
