"""Faults of the measuring tools (``measure``): what the lessons run their experiments on and count with."""
from __future__ import annotations

from .registry import fault, swap_function

AREA = "measure"


@fault("random_qkv_rows_all_equal", "measure.profile.random_qkv draws one token's q, k and v and repeats it for every "
       "token (a broadcast where one draw per row was meant): an attention output cannot tell which rows it read", AREA)
def _random_qkv_rows_all_equal():
    from ..measure import profile
    real = profile.random_qkv

    def random_qkv(*args, **kwargs):
        drawn = real(*args, **kwargs)
        same = tuple(x[:1].expand_as(x).clone() if x.shape[0] else x for x in drawn[:3])
        return same + tuple(drawn[3:])
    return [swap_function(profile, "random_qkv", random_qkv)]
