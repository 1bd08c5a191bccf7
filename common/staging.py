"""Staging memory: buffers allocated ready for copies (``staging_buffer``), and byte ranges
of a registered staging buffer handed out first-fit (``Arena``: a receiver's staging for
``staged_recv`` plans, one slice per sender of a room)."""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

log = logging.getLogger(__name__)

__all__ = ["Arena", "staging_buffer"]


class Arena:
    """First-fit allocator of byte ranges in one registered staging buffer (thread-safe:
    ``_lock`` guards the free list)."""

    def __init__(self, size: int, align: int = 256):
        self.size, self.align = size, align
        self._free: list[tuple[int, int]] = [(0, size)] if size else []
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        n = -(-n // self.align) * self.align
        with self._lock:
            for i, (off, ln) in enumerate(self._free):
                if ln >= n:
                    self._free[i] = (off + n, ln - n)
                    return off
        return None

    def free(self, off: int, n: int) -> None:
        n = -(-n // self.align) * self.align
        with self._lock:
            self._free.append((off, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, ln in self._free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + ln)
                elif ln:
                    merged.append((o, ln))
            self._free = merged


_HUGE = 2 << 20  # x86-64's transparent huge page
_MADV_HUGEPAGE = 14


def _madvise_huge(addr: int, nbytes: int) -> bool:
    """Ask for transparent huge pages over ``[addr, addr + nbytes)`` (2 MiB aligned): where
    THP is ``madvise``-only, memory nobody asked for is mapped in 4 KiB pages. Best effort."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def staging_buffer(nbytes: int, device="cpu") -> torch.Tensor:
    """A uint8 staging buffer of ``nbytes`` whose pages are already faulted in: on CPU
    2 MiB aligned, huge pages asked for (``MADV_HUGEPAGE``), then written once, so no copy
    into it pays first-touch page faults on a request's time. ``[nbytes]`` uint8."""
    dev = torch.device(device)
    if dev.type != "cpu" or nbytes < _HUGE:
        return torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    off = -raw.data_ptr() % _HUGE
    buf = raw[off: off + nbytes]
    huge = nbytes // _HUGE * _HUGE
    if _madvise_huge(buf.data_ptr(), huge):
        log.debug("staging: %d B at 0x%x, huge pages asked for", nbytes, buf.data_ptr())
    buf.zero_()
    return buf
