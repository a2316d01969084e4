"""Grouped-query attention under TP, asked of the engine: which K/V heads each rank holds, what it caches, and
what a server layout (tensor x pipeline x data parallelism) leaves in one GPU's cache.

``engine_kv_plan`` builds the engine's ranks (``LocalGroup(r, tp)``) and reads which query and K/V heads each
rank's ``QKVParallelLinear.shard_rows`` keeps and what a prefill leaves in a rank's ``PrefillKVCache``.
``run_kv_plan`` runs a forward on thread ranks (``tp.threads``, real sums) whose K/V rows come from a GIVEN plan
(which K/V heads each rank holds) and measures it against TP = 1: a plan is right when its forward is.
``layout_cache_bytes`` and ``best_layout`` size a tp x pp x dp server from ``engine_kv_plan``'s measurements.

Taught in notebooks/04_tp2_invariance.ipynb (Exercises 04.2 and 04.4).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.batch import pack
from ..core.config import ModelConfig
from ..core.groups import LocalGroup
from ..core.model import Transformer, init_weights
from ..measure.recorded import prefill_cache_bytes, zero_weights
from ..measure.tolerance import max_abs_diff, tolerance
from ..validate import check_choice, check_int, check_lengths
from .threads import tp_ranks_in_threads

GiB = 2**30
DTYPE_OF_BYTES = {2: torch.bfloat16, 4: torch.float32}


@dataclass(frozen=True)
class KVPlan:
    """A grouped-query model under TP as the engine runs it (``engine_kv_plan``)."""

    q_heads: tuple          # q_heads[r]: the query heads rank r's QKV shard holds (its Q rows)
    kv_heads: tuple         # kv_heads[r]: the K/V heads it holds (its K rows; V is cut the same way)
    bytes_per_token: int    # bytes of K and V one prefilled token leaves in ONE rank's cache, all layers

    @property
    def replicas(self) -> int:
        """How many ranks hold rank 0's first K/V head: 1, or tp / n_kv_heads when tp > n_kv_heads."""
        return sum(self.kv_heads[0][0] in held for held in self.kv_heads)

    @property
    def holders(self) -> dict[int, tuple]:
        """``{K/V head: the ranks that hold it, in rank order}``, heads in the order the ranks first hold them."""
        out: dict[int, tuple] = {}
        for r, held in enumerate(self.kv_heads):
            for j in held:
                out[j] = out.get(j, ()) + (r,)
        return out


def _rank_models(cfg: ModelConfig, tp: int, ranks: Sequence[int]) -> list[Transformer]:
    zeros = zero_weights(cfg)     # one number seen as every full weight: nothing allocated
    return [Transformer(cfg, zeros, group=LocalGroup(r, tp), attn_backend="sdpa") for r in ranks]


def _heads_of(qkv) -> tuple[tuple, tuple]:
    """The query heads and the K/V heads whose rows ``qkv.shard_rows`` keeps on its rank."""
    q_rows = qkv.n_heads * qkv.d_head                               # rows [Q | K | V] of the full weight
    rows = qkv.shard_rows(torch.arange(q_rows + 2 * qkv.n_kv_heads * qkv.d_head)).tolist()
    return (tuple(sorted({i // qkv.d_head for i in rows if i < q_rows})),
            tuple(sorted({(i - q_rows) // qkv.d_head for i in rows if q_rows <= i < q_rows + qkv.n_kv_heads * qkv.d_head})))


@functools.lru_cache(maxsize=256)  # the checkers and the lesson ask for the same few models again and again
def engine_kv_plan(n_heads: int, n_kv_heads: int, d_head: int, n_layers: int, tp: int, bytes_per_number: int,
                   num_tokens: int = 3) -> KVPlan:
    """A grouped-query model (``n_kv_heads`` K/V heads for ``n_heads`` query heads) split over ``tp``
    ranks, MEASURED on the engine's model on stand-in ranks ``LocalGroup(r, tp)``: each rank's heads are
    the rows of an index tensor its layer-0 ``QKVParallelLinear.shard_rows`` keeps; ``bytes_per_token`` is
    what a prefill of ``num_tokens`` tokens leaves in rank 0's ``PrefillKVCache`` (all layers; every
    rank's one-layer cache must agree, else RuntimeError). The models are tiny (d_model 8, zero weights):
    neither changes which rows a rank keeps or what it caches per head. ``bytes_per_number``: 2 (bfloat16)
    or 4 (float32). A tp the engine cannot split raises the engine's ValueError."""
    check_choice("bytes_per_number", bytes_per_number, tuple(DTYPE_OF_BYTES))
    n = check_int("num_tokens", num_tokens, 1)
    cfg = ModelConfig(n_layers=n_layers, d_model=8, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                      d_ffn=check_int("tp", tp, 1), vocab_size=8, max_position=n, dtype=DTYPE_OF_BYTES[bytes_per_number])
    heads, per_layer = [], set()
    for model in _rank_models(dataclasses.replace(cfg, n_layers=1), tp, range(tp)):
        heads.append(_heads_of(model.layers[0].attn.qkv))
        per_layer.add(prefill_cache_bytes(model, [n]))
    if len(per_layer) != 1:
        raise RuntimeError(f"the ranks' one-layer caches differ: {sorted(per_layer)} B for {n} tokens")
    full = prefill_cache_bytes(_rank_models(cfg, tp, [0])[0], [n])
    return KVPlan(tuple(q for q, _ in heads), tuple(kv for _, kv in heads), full // n)


def run_kv_plan(n_heads: int, n_kv_heads: int, tp: int, kv_heads: Sequence[Sequence[int]],
                seq_lens: Sequence[int] = (3, 5), d_head: int = 4, seed: int = 0) -> tuple[float, float]:
    """Run the plan ``kv_heads`` (``kv_heads[r]``: the K/V heads rank r holds, in order) in the engine: a one-layer
    grouped-query model (d_model 16, float32, ``init_weights(seed)``) on ``tp`` thread ranks that really add, each
    rank's QKV built by the engine and then its K and V rows replaced by the full weight's rows of ITS heads; a
    forward of requests of ``seq_lens`` tokens. Returns ``(error, allowed)``: max |rank 0's output - the float64
    TP = 1 output| and the tolerance rule's bound of the float32 TP = 1 output. ValueError when the plan has not
    one list per rank, or a rank's list is not as long as the K/V heads the engine's rank computes
    (``n_local_kv_heads``), or names a head outside ``0 .. n_kv_heads - 1``."""
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=check_int("d_head", d_head, 1),
                      d_ffn=32, vocab_size=32, max_position=max(check_lengths(seq_lens)))
    plan = [[int(j) for j in held] for held in kv_heads]
    if len(plan) != check_int("tp", tp, 1, 16):
        raise ValueError(f"kv_heads has {len(plan)} lists, expected one per rank: tp = {tp}")
    weights = init_weights(cfg, seed=seed)
    ids = torch.arange(sum(seq_lens)) * 5 % cfg.vocab_size
    batch = pack(list(ids.split(list(seq_lens))))

    def rank(group):
        model = Transformer(cfg, weights, group=group)
        qkv, full = model.layers[0].attn.qkv, weights["layers.0.attn.qkv.weight"]
        mine = plan[group.rank]
        if len(mine) != qkv.n_local_kv_heads or any(not 0 <= j < n_kv_heads for j in mine):
            raise ValueError(f"rank {group.rank}: kv_heads {mine}, but the engine's rank computes K and V of "
                             f"{qkv.n_local_kv_heads} head(s) out of 0..{n_kv_heads - 1}")
        with torch.no_grad():
            for part, tensor in (("weight", full), ("bias", weights["layers.0.attn.qkv.bias"])):
                local = getattr(qkv, part)
                q_rows, d = qkv.local_sizes[0], cfg.d_head
                k, v = tensor[n_heads * d:].split(n_kv_heads * d)
                rows = [x[j * d:(j + 1) * d] for x in (k, v) for j in mine]
                local[q_rows:] = torch.cat(rows)
            return model(batch)
    with torch.no_grad():
        got = tp_ranks_in_threads(tp, rank)[0][0]
        ref = Transformer(cfg, weights)(batch)
        ref64 = Transformer(cfg, weights, dtype=torch.float64, attn_backend="loop")(batch)
    return max_abs_diff(got, ref64), tolerance(ref, ref64)


def kv_heads_for_budget(n_heads: int, d_head: int, n_layers: int, tp: int, bytes_per_number: int, num_tokens: int,
                        budget_bytes: int) -> tuple[int | None, list[tuple]]:
    """A design asked of the engine: the most K/V heads (a divisor of ``n_heads``) whose cache of
    ``num_tokens`` tokens fits ``budget_bytes`` on each of ``tp`` ranks, or None when none fits.

    Every candidate is built and measured on the engine's ranks (``engine_kv_plan``); a split the
    engine refuses (a tp that neither divides the K/V heads nor is a multiple of them) is skipped.
    Also returns the table, one row per candidate: ``(n_kv_heads, K/V heads per rank, ranks per K/V
    head, cache bytes per rank, fits)``, or ``(n_kv_heads, the engine's refusal)``."""
    tokens, budget = check_int("num_tokens", num_tokens, 1), check_int("budget_bytes", budget_bytes, 1)
    check_choice("bytes_per_number", bytes_per_number, tuple(DTYPE_OF_BYTES))
    if check_int("n_heads", n_heads, 1) % check_int("tp", tp, 1):
        raise ValueError(f"tp={tp} must divide n_heads={n_heads}: every rank gets the same number of query heads")
    rows, best = [], None
    for kv in (d for d in range(1, n_heads + 1) if n_heads % d == 0):
        try:
            plan = engine_kv_plan(n_heads, kv, d_head, n_layers, tp, bytes_per_number)
        except ValueError as refused:
            rows.append((kv, str(refused)))
            continue
        held = plan.bytes_per_token * tokens
        rows.append((kv, len(plan.kv_heads[0]), plan.replicas, held, held <= budget))
        best = kv if held <= budget else best
    return best, rows


def layout_cache_bytes(n_heads: int, n_kv_heads: int, d_head: int, n_layers: int, bytes_per_number: int,
                       num_requests: int, tokens_per_request: int, tp: int, pp: int, dp: int) -> int:
    """The KV cache ONE GPU holds in a layout of ``dp`` data-parallel replicas (each serves ``num_requests / dp``
    requests of ``tokens_per_request`` tokens), each of ``pp`` pipeline stages (each ``n_layers / pp`` layers), each
    stage ``tp`` tensor-parallel ranks: MEASURED, the engine's ranks of one stage built at that tp
    (``engine_kv_plan`` with ``n_layers / pp`` layers), its rank 0's bytes per token times its replica's tokens.
    ValueError for a layout that does not split: pp not dividing the layers, dp not dividing the requests, or a tp
    the engine refuses."""
    for name, value, whole_name, whole in (("pp", pp, "n_layers", n_layers), ("dp", dp, "num_requests", num_requests)):
        if check_int(whole_name, whole, 1) % check_int(name, value, 1):
            raise ValueError(f"{name}={value} must divide {whole_name}={whole}")
    plan = engine_kv_plan(n_heads, n_kv_heads, d_head, n_layers // pp, tp, bytes_per_number)
    return plan.bytes_per_token * (num_requests // dp) * check_int("tokens_per_request", tokens_per_request, 1)


def best_layout(n_heads: int, d_head: int, n_layers: int, gpus: int, bytes_per_number: int, num_requests: int,
                tokens_per_request: int, budget_bytes: int) -> tuple[int, int, int, int] | None:
    """The most K/V heads (a divisor of ``n_heads``) for which some layout ``tp · pp · dp = gpus`` keeps one GPU's
    cache (``layout_cache_bytes``, measured) within ``budget_bytes``, with the first such layout
    ``(n_kv_heads, tp, pp, dp)`` (smallest tp, then pp); None when even one K/V head fits no layout. The search
    measures one layer's cache per token (``engine_kv_plan`` with one layer) and multiplies it by the stage's layers
    (``layout_cache_bytes`` measures a stage whole). Layouts the engine refuses (tp not dividing n_heads, or
    neither dividing nor a multiple of the K/V heads) are skipped."""
    gpus = check_int("gpus", gpus, 1)
    layouts = [(tp, pp, gpus // (tp * pp)) for tp in range(1, gpus + 1) for pp in range(1, gpus + 1)
               if gpus % (tp * pp) == 0 and n_heads % tp == 0 and n_layers % pp == 0
               and num_requests % (gpus // (tp * pp)) == 0]
    for kv in sorted((d for d in range(1, n_heads + 1) if n_heads % d == 0), reverse=True):
        for tp, pp, dp in layouts:
            try:                                          # one layer's cache per token, measured, times the stage's
                layer = engine_kv_plan(n_heads, kv, d_head, 1, tp, bytes_per_number).bytes_per_token
            except ValueError:                            # the engine refuses this tp for these K/V heads
                continue
            held = layer * (n_layers // pp) * (num_requests // dp) * tokens_per_request
            if held <= budget_bytes:
                return kv, tp, pp, dp
    return None
