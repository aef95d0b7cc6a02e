import pytest
import torch

from zero_offload.partition import SHARD_ALIGN, bucketize, build_layout, chunks, split_range

SHAPES = [("a", (3, 5)), ("b", (7,)), ("c", (2, 2, 2)), ("d", (1,))]


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_layout_pads_to_equal_aligned_shards(shards):
    layout = build_layout(SHAPES, shards)
    assert layout.numel == 15 + 7 + 8 + 1
    assert layout.padded_numel % (shards * SHARD_ALIGN) == 0
    assert layout.padded_numel >= layout.numel
    ranges = [layout.shard_range(r) for r in range(shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_views_and_flatten_round_trip():
    layout = build_layout(SHAPES, 2)
    tensors = [torch.randn(s) for _, s in SHAPES]
    flat = torch.full((layout.padded_numel,), 7.0)
    layout.flatten_into(flat, tensors)
    for t, v in zip(tensors, layout.views(flat)):
        assert torch.equal(t, v)
    assert flat[layout.numel :].eq(0).all()
    layout.flatten_into(flat, [None, tensors[1], None, tensors[3]])
    assert layout.views(flat)[0].eq(0).all() and torch.equal(layout.views(flat)[1], tensors[1])


def test_overlaps_cover_every_element_once():
    layout = build_layout([("a", (100,)), ("b", (50,)), ("c", (90,))], 4, align=16)
    seen = {i: [] for i in range(3)}
    for shard in range(4):
        for o in layout.overlaps(shard):
            seen[o.slot].append((o.slot_start, o.slot_end))
            lo, _ = layout.shard_range(shard)
            assert lo + o.shard_start == layout.slots[o.slot].offset + o.slot_start
    for i, slot in enumerate(layout.slots):
        pieces = sorted(seen[i])
        assert pieces[0][0] == 0 and pieces[-1][1] == slot.numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def test_bad_sizes_are_rejected():
    layout = build_layout(SHAPES, 2)
    with pytest.raises(ValueError, match="flat buffer"):
        layout.views(torch.zeros(3))
    with pytest.raises(IndexError):
        layout.shard_range(2)
    with pytest.raises(ValueError):
        build_layout(SHAPES, 0)


def test_bucketize():
    assert bucketize([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    assert bucketize([], 10) == []


@pytest.mark.parametrize("numel,size", [(0, 4), (1, 4), (4, 4), (10, 4), (10, 1), (3, 8)])
def test_chunks_cover_the_range_in_pieces_of_size(numel, size):
    got = chunks(numel, size)
    assert [lo for lo, _ in got] == list(range(0, numel, size))
    assert all(hi - lo == size for lo, hi in got[:-1])
    assert sum(hi - lo for lo, hi in got) == numel and (not got or got[-1][1] == numel)


@pytest.mark.parametrize("size", [1, 3, 7, 16])
def test_split_range_cuts_exactly_at_chunk_bounds(size):
    numel = 50
    bounds = chunks(numel, size)
    for start in range(numel + 1):
        for end in range(start, numel + 1):
            pieces = split_range(start, end, size)
            if start == end:
                assert pieces == []
                continue
            # contiguous, covering [start, end), each inside the chunk it names
            assert [a for _, a, _ in pieces] == [start] + [b for _, _, b in pieces[:-1]]
            assert pieces[-1][2] == end
            for i, a, b in pieces:
                lo, hi = bounds[i]
                assert lo <= a < b <= hi
            # cut only where chunks meet: one piece per chunk the range touches
            assert [i for i, _, _ in pieces] == list(range(start // size, -(-end // size)))


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk size"):
        chunks(10, 0)
    with pytest.raises(ValueError, match="chunk size"):
        split_range(0, 10, 0)
