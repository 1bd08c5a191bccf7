"""The benches' one-thread memcpy (``kvbridge.bench.machine``): the copy a one-thread
gather is measured against, with the C tile copy's streamed stores."""

from __future__ import annotations

import torch

from kvbridge.bench.machine import copy_parts_one_thread, streamed_copy


def test_streamed_copy_is_a_memcpy_and_refuses_what_it_cannot_stream():
    """``streamed_copy`` (the one-thread memcpy ``bench layout`` holds the gather to): the
    destination gets exactly the source's bytes and nothing past them; unaligned or odd
    sizes are refused untouched (False), so the bench falls back to numpy's memcpy."""
    src = torch.randint(0, 256, ((3 << 20) + 64,), dtype=torch.uint8)
    buf = torch.full(((3 << 20) + 256,), 0x5A, dtype=torch.uint8)
    base = (-buf.data_ptr()) % 64
    n = 3 << 20
    assert streamed_copy(buf[base: base + n], src[:n])
    assert torch.equal(buf[base: base + n], src[:n])
    assert (buf[:base] == 0x5A).all() and (buf[base + n:] == 0x5A).all()
    buf.fill_(0x5A)
    assert not streamed_copy(buf[base + 8: base + 8 + n], src[:n])  # destination 8 bytes off 16
    assert not streamed_copy(buf[base: base + n], src[:n - 8])  # not a multiple of 16 bytes
    assert not streamed_copy(buf[base: base + 1024], src[:n])  # destination too small
    assert (buf == 0x5A).all()


def test_parts_copied_into_a_ring_in_turn():
    """``copy_parts_one_thread``: each part lands in the ring's next region, the last
    (short, not a multiple of 16 bytes: numpy's memcpy) included."""
    part, regions = 1 << 16, 2
    src = torch.randint(0, 256, (3 * part + 40,), dtype=torch.uint8)
    ring = torch.zeros(regions * part, dtype=torch.uint8)
    copy_parts_one_thread(ring, src, part, regions)
    assert torch.equal(ring[:part], src[2 * part: 3 * part])  # the third part over the first
    assert torch.equal(ring[part: part + 40], src[3 * part:])  # the fourth over the second's start
    assert torch.equal(ring[part + 40: 2 * part], src[part + 40: 2 * part])
