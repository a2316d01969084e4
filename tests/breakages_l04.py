"""The claims lesson 04 proves, and the faults that break them (see breakages.py).

The grouped-query C11 cell (the second) and the C12 cell of request B's rows (before the first) are not the first
claim cells of their ids, so their faults are named in the notebook, where tools/claims_coverage.py finds them:
``kv_repeated_before_cache``, ``kv_replicas_dealt_round_robin``, ``kv_block_rank_mod_replicas`` (grouped-query
C11) and ``attention_ignores_cu_seqlens``, ``loop_causal_off_by_one`` (B's rows). tests/test_course_l04.py runs
the grouped-query C11 cell with ``kv_replicas_dealt_round_robin``."""
from breakages import breaks

from lessons_lib.faults.linear import kv_replicas_round_robin  # noqa: F401  (tests/test_course_l04.py imports it here)

NOTEBOOK = "04_tp2_invariance"

breaks("C11", NOTEBOOK, "qkv_sharded_as_one_block")
breaks("C11", NOTEBOOK, "qkv_computed_whole_on_every_rank", variant="qkv_not_cut")
breaks("C11", NOTEBOOK, "attention_gathers_every_head", variant="collective_in_attention")
breaks("C12", NOTEBOOK, "row_parallel_bias_on_every_rank")
breaks("C12", NOTEBOOK, "model_runs_requests_one_at_a_time", variant="per_request")
breaks("C12", NOTEBOOK, "all_reduce_in_64k_buckets", variant="buckets")
