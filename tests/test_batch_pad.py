"""core.batch.pad's ``pad_to`` and ``side`` (Hugging Face's ``padding_side``): where the pad rows go."""
import pytest
import torch

from lessons_lib.core.batch import pad


def test_right_and_left_padding_to_a_width_put_each_requests_tokens_where_the_side_says():
    a, b = torch.tensor([1, 2]), torch.tensor([3, 4, 5])
    right, right_mask = pad([a, b], pad_value=-1, pad_to=4)
    left, left_mask = pad([a, b], pad_value=-1, pad_to=4, side="left")
    assert right.tolist() == [[1, 2, -1, -1], [3, 4, 5, -1]]
    assert left.tolist() == [[-1, -1, 1, 2], [-1, 3, 4, 5]]
    assert right_mask.tolist() == [[True, True, False, False], [True, True, True, False]]
    assert left_mask.tolist() == [[False, False, True, True], [False, True, True, True]]
    for ids, mask in ((right, right_mask), (left, left_mask)):
        assert [ids[r][mask[r]].tolist() for r in range(2)] == [[1, 2], [3, 4, 5]]


def test_hidden_rows_left_padded_to_the_longest_keep_their_width():
    rows = [torch.randn(1, 3), torch.randn(2, 3)]
    out, mask = pad(rows, side="left")
    assert out.shape == (2, 2, 3) and torch.equal(out[0, 1], rows[0][0]) and not out[0, 0].any()
    assert mask.tolist() == [[False, True], [True, True]]


@pytest.mark.parametrize("kw, message", [({"side": "middle"}, "side must be"), ({"pad_to": 2}, "pad_to must be"),
                                         ({"pad_to": 4.0}, "pad_to must be"), ({"pad_to": True}, "pad_to must be")])
def test_bad_pad_to_or_side_is_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        pad([[1, 2, 3]], **kw)
