"""The wire form of a state download (peer/state_stream.py, note "state stream"): what the donor's parts
rebuild, its interoperation with hivemind's own split and combine, and the refusals of a bad stream."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from peer.state_stream import StateAssembler, shared_empty, state_parts


def assemble(parts, empty=shared_empty, max_numel=None) -> list[torch.Tensor]:
    assembler = StateAssembler(empty, max_numel)
    for part in parts:
        assembler.add(part)
    return assembler.finish()


def test_parts_rebuild_the_tensors_in_shared_memory():
    a = torch.randn(1000)
    b = torch.randn(3, 7)
    parts = [*state_parts(a, part_bytes=512), *state_parts(b, part_bytes=512)]
    assert len(parts) == 8 + 1  # 4000 bytes in parts of 512, then 84 bytes in one
    got = assemble(parts)
    assert [t.shape for t in got] == [a.shape, b.shape]
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    assert all(t.is_shared() for t in got)  # the host process gets a handle, not another copy


def test_both_directions_interoperate_with_hiveminds_own_path():
    t = torch.randn(5000)
    ours = list(state_parts(t, part_bytes=4096))
    assert torch.equal(deserialize_torch_tensor(combine_from_streaming(ours)), t)
    theirs = list(split_for_streaming(serialize_torch_tensor(t), 4096))
    [back] = assemble(theirs)
    assert torch.equal(back, t)


def test_other_dtypes_and_empty_tensors_take_hiveminds_path_or_pass_whole():
    ints = torch.arange(10, dtype=torch.int64)
    halves = torch.randn(33).to(torch.bfloat16)
    empty = torch.zeros(0)
    got = assemble([*state_parts(ints, 16), *state_parts(halves, 16), *state_parts(empty)])
    assert torch.equal(got[0], ints) and torch.equal(got[1], halves)
    assert got[2].shape == (0,)


def test_a_stream_that_does_not_match_its_header_is_refused():
    t = torch.randn(100)
    parts = list(state_parts(t, part_bytes=128))
    with pytest.raises(ValueError, match=r"ended after 384 of 400 bytes"):
        assemble(parts[:-1])
    extra = [*parts, parts[-1]]
    extra[-1] = type(parts[1])(buffer=parts[1].buffer)  # a further part without a header
    with pytest.raises(ValueError, match=r"sent 528 bytes for a tensor of 400 bytes"):
        assemble(extra)
    with pytest.raises(ValueError, match="before the first part"):
        assemble(parts[1:])


def test_a_header_announcing_more_than_the_state_holds_is_refused_before_allocating():
    allocated = []

    def empty(numel: int) -> torch.Tensor:
        allocated.append(numel)
        return torch.empty(numel)

    a, b = torch.randn(10), torch.randn(5)
    assert [t.numel() for t in assemble([*state_parts(a), *state_parts(b)], empty, max_numel=15)] == [10, 5]
    allocated.clear()
    with pytest.raises(ValueError, match=r"shape \(5,\) \(5 elements\) where at most 4 more were expected"):
        assemble([*state_parts(torch.randn(11)), *state_parts(b)], empty, max_numel=15)
    assert allocated == [11]  # the first fitted; the second was refused before its allocation


def test_a_tensor_that_hivemind_rebuilds_may_not_bring_more_bytes_than_its_header_allows():
    """Parts of a non-float32 tensor are collected before hivemind rebuilds it: a donor that keeps
    sending them is stopped at 8 bytes an element (plus headers), not when the receiver runs out."""
    ints = torch.arange(100, dtype=torch.int64)  # 800 bytes: exactly 8 an element
    parts = list(state_parts(ints, 64))
    [back] = assemble(parts)
    assert torch.equal(back, ints)
    endless = [*parts, *([type(parts[1])(buffer=b"x" * 1024)] * 5)]
    with pytest.raises(ValueError, match=r"over 4896 bytes for a 100-element tensor of shape \(100,\)"):
        assemble(endless)
