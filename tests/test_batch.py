"""Flat batches (batch.py): pack / unpack / pad, flash-attn's unpad_input / pad_input, and the
article's running example A=10, B=30 (claims C2, C3)."""
from itertools import accumulate

import pytest
import torch

from lessons_lib.core.attention import varlen_attention
from lessons_lib.core.batch import PackedBatch, pack, pad, pad_input, seq_lens_to_cu_seqlens, unpack, unpad_input
from lessons_lib.measure.flops import attention_cells, executed_tokens
from lessons_lib.validate import check_batch, check_cu_seqlens


@pytest.fixture
def a_b_hidden():
    g = torch.Generator().manual_seed(0)
    return torch.randn(10, 512, generator=g), torch.randn(30, 512, generator=g)


def test_c3_pack_a_b_is_40x512_with_cu_seqlens_0_10_40(a_b_hidden):
    a, b = a_b_hidden
    batch = pack([a, b])
    assert batch.hidden.shape == (40, 512) and batch.input_ids is None
    assert torch.equal(batch.hidden, torch.cat([a, b]))  # concatenated, nothing between them
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 10, 40]
    assert batch.positions.tolist() == list(range(10)) + list(range(30))  # restart at 0 per request
    assert (batch.seq_lens, batch.max_seqlen, batch.num_tokens, batch.num_seqs) == ([10, 30], 30, 40, 2)
    assert batch.last_token_indices.tolist() == [9, 39]
    assert check_batch(None, batch) == [0, 10, 40]


def test_c3_request_i_owns_rows_cu_i_to_cu_i_plus_1(a_b_hidden):
    a, b = a_b_hidden
    batch = pack([a, b])
    parts = unpack(batch.hidden, batch.cu_seqlens)
    assert torch.equal(parts[0], a) and torch.equal(parts[1], b)
    assert parts[1].data_ptr() == batch.hidden[10:].data_ptr()  # views into the flat buffer, no copy


def test_pack_token_ids_lists_and_tensors_agree():
    lists = [[5, 6, 7], [1], [9, 9]]
    from_lists = pack(lists)
    from_tensors = pack([torch.tensor(r, dtype=torch.int32) for r in lists])
    assert from_lists.input_ids.dtype == torch.int64 and from_tensors.input_ids.dtype == torch.int64
    assert from_lists.input_ids.tolist() == [5, 6, 7, 1, 9, 9] == from_tensors.input_ids.tolist()
    assert from_lists.cu_seqlens.tolist() == [0, 3, 4, 6] == from_tensors.cu_seqlens.tolist()
    assert from_lists.positions.dtype == torch.int64


def test_c2_padding_a_b_gives_2x30_rows_60_computed_40_useful():
    a, b = list(range(10)), list(range(100, 130))
    padded, mask = pad([a, b], pad_value=-1)
    assert padded.shape == (2, 30) and mask.shape == (2, 30)
    assert int(mask.sum()) == 40 and int((~mask[0]).sum()) == 20 and bool(mask[1].all())
    assert padded[0, 10:].eq(-1).all() and padded[0, :10].tolist() == a
    rows_computed, rows_useful = padded.numel(), int(mask.sum())  # independent of flops.py
    assert executed_tokens([10, 30], "padded") == rows_computed == 60
    assert executed_tokens([10, 30], "varlen") == rows_useful == 40
    # Two ratios, stated apart: the batch runs 1.5x the rows it needs, A alone runs 3x its rows.
    assert rows_computed / rows_useful == 1.5 and padded.shape[1] / int(mask[0].sum()) == 3


def test_c2_padding_costs_a_900_score_cells_instead_of_100_9x():
    _, mask = pad([list(range(10)), list(range(30))])
    s = mask.shape[1]
    cells_a_padded, cells_a_alone = s * s, int(mask[0].sum()) ** 2  # A's score matrix padded vs alone
    assert (cells_a_padded, cells_a_alone) == (900, 100) and cells_a_padded // cells_a_alone == 9
    padded_cells = attention_cells([10, 30], "padded")
    assert padded_cells.computed == mask.shape[0] * s * s == 1800  # 900 for A + 900 for B
    assert padded_cells.useful == 100 + 900 and padded_cells.wasted == 800


def test_pad_hidden_rows_and_mask():
    g = torch.Generator().manual_seed(1)
    reqs = [torch.randn(n, 8, generator=g) for n in (3, 1, 5)]
    padded, mask = pad(reqs)
    assert padded.shape == (3, 5, 8) and mask.sum(1).tolist() == [3, 1, 5]
    assert torch.equal(padded[mask], torch.cat(reqs)) and padded[~mask].eq(0).all()


@pytest.mark.parametrize("lens", [[1], [3, 0, 2], [0, 0], [5, 5, 1]])
def test_seq_lens_to_cu_seqlens_is_the_prefix_sum(lens):
    cu = seq_lens_to_cu_seqlens(lens)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *accumulate(lens)]


def test_unpad_input_pad_input_match_boolean_indexing():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 7, 3, 2, generator=g)
    mask = torch.rand(4, 7, generator=g) > 0.4  # arbitrary holes, not only right padding
    mask[2] = False  # an all-pad row: zero-length request, a repeated cu_seqlens entry
    flat, indices, cu, max_len, seqused = unpad_input(x, mask)
    assert torch.equal(flat, x[mask])  # row-major order, as flash_attn.bert_padding
    assert seqused.dtype == torch.int32 and seqused.tolist() == mask.sum(1).tolist()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *accumulate(mask.sum(1).tolist())]
    assert max_len == int(mask.sum(1).max()) and indices.tolist() == mask.flatten().nonzero().flatten().tolist()
    back = pad_input(flat, indices, 4, 7)
    assert torch.equal(back[mask], x[mask]) and back[~mask].eq(0).all()


def test_zero_length_request_pack_rejects_it():
    """Documented in batch.py: a prompt with no token has no last token, so pack/pad reject it."""
    with pytest.raises(ValueError, match=r"requests\[1\] has length 0"):
        pack([[1, 2], [], [3]])
    with pytest.raises(ValueError, match=r"requests\[1\] has length 0"):
        pad([[1, 2], [], [3]])


def test_zero_length_request_cu_seqlens_passes_and_attention_writes_no_row(make_qkv):
    """Documented in batch.py: check_cu_seqlens accepts repeated entries (FlashAttention does);
    attention then writes no row for the empty request and the others are unaffected."""
    assert check_cu_seqlens(torch.tensor([0, 3, 3, 7], dtype=torch.int32), 7) == [0, 3, 3, 7]
    q, k, v, cu, _ = make_qkv([3, 0, 4], heads=2, d_head=8)
    out = varlen_attention(q, k, v, cu, backend="loop")
    assert out.shape == q.shape  # 7 rows: 3 + 0 + 4
    alone = [varlen_attention(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], dtype=torch.int32), backend="loop")
             for s, e in ((0, 3), (3, 7))]
    assert torch.equal(out, torch.cat(alone))


def test_packed_batch_to_and_validate_roundtrip():
    batch = pack([[1, 2, 3], [4]])
    moved = batch.to("cpu")
    assert isinstance(moved, PackedBatch) and moved.seq_lens is not batch.seq_lens
    assert check_batch(None, moved) == [0, 3, 4]
    moved.max_seqlen = 10  # an upper bound is legal (FlashAttention's max_seqlen is one)
    assert check_batch(None, moved) == [0, 3, 4]
