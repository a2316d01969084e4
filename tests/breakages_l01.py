"""Breakages of the claims lesson 01 proves (see breakages.py)."""
from breakages import breaks


@breaks("S2", "01_flat_batch", "the embedding forgets the position table: a row is wte[token] only")
def _embedding_without_positions():
    from lessons_lib.core import model

    def embed(self, batch):
        return batch.hidden if batch.input_ids is None else self.wte[batch.input_ids]

    model.Transformer.embed = embed


@breaks("C2", "01_flat_batch", "pad returns a mask that is all True: pad rows are counted (and attended) as real")
def _mask_all_true():
    import torch

    from lessons_lib.core import batch

    real = batch.pad

    def pad(requests, pad_value=0):
        out, mask = real(requests, pad_value)
        return out, torch.ones_like(mask)

    batch.pad = pad


@breaks("C3", "01_flat_batch", "pack numbers positions 0..T-1 across the batch instead of restarting for every request")
def _positions_do_not_restart():
    import torch

    from lessons_lib.core import batch

    real = batch.pack

    def pack(requests, device=None, **kw):
        out = real(requests, device, **kw)
        out.positions = torch.arange(out.num_tokens, device=out.positions.device)
        return out

    batch.pack = pack


@breaks("C2", "01_flat_batch", "the padded forward quietly runs only the real rows: what the recorder sees executed no "
        "longer matches the R x Lmax rows that measure.flops predicts for padding", variant="recorded-rows")
def _padded_forward_runs_real_rows_only():
    from lessons_lib.core import model
    from lessons_lib.core.batch import pack

    def forward_padded(self, input_ids, attention_mask):
        mask = attention_mask.bool()
        flat = self.forward(pack([row[m] for row, m in zip(input_ids, mask)], device=input_ids.device))
        out = flat.new_zeros(*input_ids.shape, flat.shape[-1])
        out[mask] = flat
        return out

    model.Transformer.forward_padded = forward_padded
