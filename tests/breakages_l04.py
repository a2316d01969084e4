"""The claims lesson 04 proves, and the faults that break them (see breakages.py).

The fault ``kv_replicas_dealt_round_robin`` is not a row here: the MHA claim cell of C11 cannot see it
(no replicas); tests/test_course_l04.py runs lesson 04's grouped-query C11 cell with it."""
from breakages import breaks

from lessons_lib.faults.linear import kv_replicas_round_robin  # noqa: F401  (tests/test_course_l04.py imports it here)

NOTEBOOK = "04_tp2_invariance"

breaks("C11", NOTEBOOK, "qkv_sharded_as_one_block")
breaks("C12", NOTEBOOK, "row_parallel_bias_on_every_rank")
