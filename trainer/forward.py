"""Forward passes over (prompt, response) pairs: token log-probs, entropies and values.

A micro-batch is a list of sequences `prompt + response`. Two layouts, same results:

* packed (`use_remove_padding=True`): all sequences concatenated into one row with
  `cu_seqlens`; no compute is spent on padding.
* padded: prompts left-padded to the longest prompt, responses right-padded, so every
  response starts at the same column.

With Ulysses sequence parallelism (packed only, `sharding.ulysses`) the packed row is padded to a
multiple of the group size and each rank of the group runs the model on its contiguous shard of
it: the positions it scores are those of its shard, and the outputs are gathered over the group
(in position order: the order of the unsharded micro-batch) before they are placed.

Routing replay (mixture-of-experts models) goes both ways through these layouts: each row's experts per token
(`RolloutBatch.routed_experts`, a `Ragged` of `[tokens, sparse layers, k]` rows) are laid out with its tokens for the
model to replay (`build_micro_batch`), and the record of a forward's own routing (R2's old-log-prob pass) comes back
to the rows (`RoutingRecord`): both through `MicroBatch.token_places`, where each row's tokens sit in the laid-out
micro-batch.

Either way the output is `[B, R]` (R = the batch's response width) holding, for response
token j of sequence b, the quantity computed at the position that predicts it (log-prob of
the token, entropy of that position's distribution, or the value of the state before it).
Padding positions hold 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.attention import PrefixSharing
from models.transfer import host_to_device
from sharding import comm
from trainer.batching import Ragged, prompt_groups
from sharding.ulysses import SequenceParallel, gather_rows, padded_length, per_shard_counts, shard_bounds


@dataclass
class MicroBatch:
    input_ids: torch.Tensor          # [1, T] packed or [B, S] padded
    labels: torch.Tensor             # same shape: the next token of the same segment at each position
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int | None
    src_index: torch.Tensor          # flat positions in the model output that predict response tokens
    src_labels: torch.Tensor         # the response token each of them predicts
    dst_row: torch.Tensor            # where each goes in the [B, R] result
    dst_col: torch.Tensor
    last_index: torch.Tensor         # flat position of each sequence's last token (reward models)
    batch_size: int
    # Ulysses: the group, and how many of the scored / last positions each of its ranks' shards holds
    # (`src_index` and `last_index` are then this rank's, relative to its shard)
    sp: SequenceParallel | None = None
    src_counts: list[int] | None = None
    last_counts: list[int] | None = None
    # prefix sharing: each segment's keys, and the row of each `last_index` entry (None: rows in order)
    shared: PrefixSharing | None = None
    last_rows: torch.Tensor | None = None
    # the work of the whole micro-batch (every shard): tokens run, scored positions, attention pairs
    work: tuple[int, int, float] = (0, 0, 0.0)
    # routing replay: the experts of each token of `input_ids` (this rank's shard) in each sparse layer,
    # `[*input_ids.shape, sparse layers, k]` (0 on padding); None: the routers route
    routed_experts: torch.Tensor | None = None
    # each row's tokens (prompt + response), their flat places in the whole micro-batch's tokens (every shard's, the
    # padded layout's `B x S`): a shared prompt's places its first row's, where it is laid out (host, int64)
    token_places: Ragged | None = None
    # routing replay R2's record: the forward returns the experts its routers chose (`RoutingRecord`)
    record_routing: bool = False

    def gather(self, x: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Every rank's values at its scored (`last`: last) positions, in position order; `x` itself
        without sequence parallelism."""
        if self.sp is None:
            return x
        return gather_rows(x, self.sp, self.last_counts if last else self.src_counts)

    def model_kwargs(self) -> dict:
        """The layout arguments of `Transformer.forward` for this micro-batch."""
        kwargs = dict(position_ids=self.position_ids, attention_mask=self.attention_mask,
                      cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen, shared=self.shared)
        if self.routed_experts is not None:
            kwargs["routed_experts"] = self.routed_experts
        return kwargs | {"record_routing": True} if self.record_routing else kwargs


def build_micro_batch(prompts: Ragged | list[list[int]], responses: Ragged | list[list[int]], device, packed: bool,
                      pad_token_id: int = 0, sp: SequenceParallel | None = None,
                      share_prefix: bool = False, routed_experts: Ragged | None = None,
                      record_routing: bool = False) -> MicroBatch:
    """Lay out `prompts[i] + responses[i]` for one forward pass (`sp`: this rank's shard of the packed
    row, for its Ulysses group; `share_prefix`: rows with the same prompt tokens share one copy of
    it, packed layout only, see `_packed_micro_batch`). `routed_experts` (routing replay: row i holds, for
    each token of `prompts[i] + responses[i]`, its experts `[sparse layers, k]`) is laid out as the tokens are,
    into `MicroBatch.routed_experts` (a shared prompt's from its first row). `record_routing`: the forward
    records its own routing (`MicroBatch.record_routing`, `RoutingRecord`).

    Everything is built on the host with NumPy (whole-array operations on the rows' flat arrays,
    `Ragged`; lists of rows are converted first; no per-sequence loop) and moved in one copy from pinned memory that does not wait for
    the device: a blocking host-to-device copy synchronises the stream, which in an update loop
    would let the GPU drain before every micro-batch. No torch CPU op runs here: those that split
    work over torch's CPU threads (`repeat_interleave`, `cat`) waited up to 3 ms for them on the
    GPU machine's host in a profiled update, with the GPU idle."""
    if not len(prompts):  # a rank with no work still runs one forward (FSDP collectives must match)
        prompts, responses = [[pad_token_id]], [[]]
        if routed_experts is not None:
            routed_experts = Ragged(np.zeros((1, *routed_experts.flat.shape[1:]), routed_experts.flat.dtype),
                                    np.array([0, 1]))
    prompts, responses = Ragged.of(prompts, np.int64), Ragged.of(responses, np.int64)
    n = len(prompts)
    lp, lr = prompts.lengths(), responses.lengths()
    if routed_experts is not None and not np.array_equal(routed_experts.lengths(), lp + lr):
        raise ValueError(f"routed experts for sequences of {routed_experts.lengths().tolist()} tokens, laid out "
                         f"with {(lp + lr).tolist()}")
    # every response token j of sequence b: its row b and its column j
    rows = np.repeat(np.arange(n), lr)
    cols = np.arange(int(lr.sum())) - np.repeat(np.cumsum(lr) - lr, lr)
    lengths = lp + lr
    ends = np.cumsum(lengths)
    # every token of every row, rows in order: its row and its index in its sequence
    seq = np.repeat(np.arange(n), lengths)
    within = np.arange(int(ends[-1])) - np.repeat(ends - lengths, lengths)
    if packed:
        leaders = prompt_groups(prompts) if share_prefix else np.arange(n)
        mb, places, (lo, hi) = _packed_micro_batch(prompts, responses, leaders, lp, lr, rows, cols, seq, within,
                                                   device, pad_token_id, sp)
        laid = (leaders == np.arange(n))[seq] | (within >= lp[seq])  # a shared prompt's tokens: its first row's
        shape = (1, hi - lo)
    else:
        if sp is not None:
            raise ValueError("sequence parallelism needs the packed layout (use_remove_padding=true)")
        if share_prefix:
            raise ValueError("prefix sharing needs the packed layout (use_remove_padding=true)")
        flat = _laid_out(prompts, responses, np.arange(n), np.ones(n, dtype=bool))
        mb, places = _padded_micro_batch(flat, seq, within, lp, lr, rows, cols, device, pad_token_id)
        laid, shape = slice(None), tuple(mb.input_ids.shape)
        lo, hi = 0, mb.input_ids.numel()
    mb.token_places, mb.record_routing = Ragged(places, np.concatenate([[0], ends])), record_routing
    if routed_experts is not None:
        # each laid-out token's experts, zeros on the padding; this rank's shard
        routed = np.zeros((max(hi, int(places.max(initial=-1)) + 1), *routed_experts.flat.shape[1:]),
                          routed_experts.flat.dtype)
        routed[places[laid]] = routed_experts.flat[laid]
        mb.routed_experts, = host_to_device([routed[lo:hi].reshape(*shape, *routed.shape[1:])], device)
    return mb


def _laid_out(prompts: Ragged, responses: Ragged, order: np.ndarray, with_prompt: np.ndarray) -> np.ndarray:
    """The tokens of `prompts[b]` (where `with_prompt[b]`) and then of `responses[b]`, for each row b
    of `order`, one after the other (int64): taken from the rows' flat arrays, no per-row list."""
    n = len(prompts)
    both = Ragged.concat([prompts, responses])  # rows 0..n-1 the prompts, n..2n-1 the responses
    pieces = np.stack([order, order + n], 1)
    wanted = np.stack([with_prompt[order], np.ones(len(order), dtype=bool)], 1)
    return both.take(pieces[wanted]).flat.astype(np.int64, copy=False)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`starts[i], ..., starts[i] + lengths[i] - 1` for each i, concatenated."""
    return np.arange(int(lengths.sum())) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)


def _packed_micro_batch(prompts, responses, leaders, lp, lr, rows, cols, seq, index, device, pad_token_id: int,
                        sp: SequenceParallel | None) -> tuple[MicroBatch, np.ndarray, tuple[int, int]]:
    """All sequences end to end in one row, with `cu_seqlens`; positions restart at 0.

    Prefix sharing (`leaders[b]`: the first row with row b's prompt; each row its own without it):
    a group of rows with one prompt lays out the prompt once, then each response as a segment of
    its own, at the positions it has after the prompt; its attention reads the prompt's keys
    (`models.attention.PrefixSharing`), and its first token is predicted by the prompt's last
    position, which scores one token for each response. The forward then computes what it
    computes for `prompt + response` rows, with the prompt's tokens run once.

    With `sp` the row is padded to a multiple of the group size (the padding is a sequence of its
    own, so no real token attends to it) and this rank keeps its shard of the tokens, labels and
    positions; the scored and last positions go in position order (`MicroBatch.gather`).

    Returns the micro-batch, the places in the row of every token of every row (`seq`: its row, `index`: its index
    in its sequence; a shared prompt's tokens where its first row lays them out) and this rank's bounds `[lo, hi)`
    of the row (for `build_micro_batch`'s `MicroBatch.token_places` and routed experts)."""
    n = len(lp)
    own = leaders == np.arange(n)
    sharing = np.bincount(leaders, minlength=n)[leaders] > 1  # rows of a group of two or more
    order = np.argsort(leaders, kind="stable")  # groups by their first row, rows in order within
    ep = np.where(own, lp, 0)  # the prompt tokens each row lays out
    emitted = ep + lr
    start = np.empty(n, dtype=np.int64)
    start[order] = np.cumsum(emitted[order]) - emitted[order]
    pstart = start[leaders]  # where the row's prompt lies
    places = np.where(index < lp[seq], pstart[seq], (start + ep - lp)[seq]) + index
    flat = _laid_out(prompts, responses, order, own)
    within = (np.arange(len(flat)) + np.repeat((lp - ep - start)[order], emitted[order]))  # positions
    # Segments, two candidates a row in emitted order: a row alone its whole sequence; a sharing row its
    # prompt if it lays it out, then its response, which reads the prompt first. Empty ones dropped.
    seg_len = np.stack([np.where(sharing, ep, emitted), np.where(sharing, lr, 0)], 1)[order].reshape(-1)
    seg_start = np.stack([start, start + ep], 1)[order].reshape(-1)
    pre_start = np.stack([np.zeros(n, np.int64), pstart], 1)[order].reshape(-1)
    pre_len = np.stack([np.zeros(n, np.int64), np.where(sharing, lp, 0)], 1)[order].reshape(-1)
    keep = seg_len > 0
    seg_len, seg_start, pre_start, pre_len = seg_len[keep], seg_start[keep], pre_start[keep], pre_len[keep]
    ends = np.cumsum(seg_len)
    labels = np.empty_like(flat)  # the next token of the same segment; the pad after its last
    labels[:-1] = flat[1:]
    labels[ends - 1] = pad_token_id
    cu_seqlens = np.concatenate([[0], ends])
    max_seqlen = int(seg_len.max())
    # the position before each response token predicts it: the prompt's last for its first token
    src = np.where(cols == 0, (pstart + lp - 1)[rows], (start + ep)[rows] + cols - 1)
    src_labels = responses.flat.astype(np.int64, copy=False)
    last = np.where(lr > 0, start + emitted - 1, pstart + lp - 1)
    key_len = pre_len + seg_len
    work = (len(flat), len(src), float((seg_len * pre_len + seg_len * seg_len / 2).sum()))
    shared = bool(sharing.any())
    if shared:  # scored and last positions in position order (`MicroBatch.gather`)
        by_pos = np.argsort(src, kind="stable")
        src, src_labels, rows, cols = src[by_pos], src_labels[by_pos], rows[by_pos], cols[by_pos]
        last_rows = np.argsort(last, kind="stable")
        last = last[last_rows]
        kv_index = _ranges(np.stack([pre_start, seg_start], 1).reshape(-1), np.stack([pre_len, seg_len], 1).reshape(-1))
        cu_k = np.concatenate([[0], np.cumsum(key_len)])
    total = len(flat) if sp is None else padded_length(len(flat), sp.size)
    pad = total - len(flat)
    if pad:
        flat = np.concatenate([flat, np.full(pad, pad_token_id, dtype=flat.dtype)])
        labels = np.concatenate([labels, np.full(pad, pad_token_id, dtype=labels.dtype)])
        within = np.concatenate([within, np.arange(pad, dtype=within.dtype)])
        cu_seqlens = np.concatenate([cu_seqlens, [total]])
        max_seqlen = max(max_seqlen, pad)
        if shared:
            kv_index = np.concatenate([kv_index, np.arange(total - pad, total)])
            cu_k = np.concatenate([cu_k, [cu_k[-1] + pad]])
            key_len = np.concatenate([key_len, [pad]])
    lo, hi = (0, total) if sp is None else shard_bounds(total, sp)
    if sp is None:
        src_counts = last_counts = None
        mine_src, mine_labels, mine_last = src, src_labels, last
    else:
        src_counts, last_counts = per_shard_counts(src, total, sp.size), per_shard_counts(last, total, sp.size)
        in_shard = (src >= lo) & (src < hi)
        mine_src, mine_labels = src[in_shard] - lo, src_labels[in_shard]
        mine_last = last[(last >= lo) & (last < hi)] - lo
    arrays = [flat[None, lo:hi], labels[None, lo:hi], within[None, lo:hi], cu_seqlens, mine_src, mine_labels, rows,
              cols, mine_last]
    if shared:
        arrays += [kv_index, cu_k, last_rows]
    ids, labels_t, pos, cu_t, *index = host_to_device(arrays, device)
    layout = None
    if shared:
        kv_t, cu_k_t, last_rows_t = index[5:]
        index = index[:5]
        layout = PrefixSharing(kv_t, cu_k_t.int(), int(key_len.max()))
    mb = MicroBatch(ids, labels_t, pos, None, cu_t.int(), max_seqlen, *index, n, sp, src_counts, last_counts,
                    layout, last_rows_t if shared else None, work)
    return mb, places, (lo, hi)


def _padded_micro_batch(flat, seq, within, lp, lr, rows, cols, device,
                        pad_token_id: int) -> tuple[MicroBatch, np.ndarray]:
    """Prompts left-padded to the longest prompt and responses right-padded, so that every
    response starts at the same column `max_p`. `flat`: the rows' tokens in order, `seq` and `within` each
    one's row and index in its sequence. Returns the micro-batch and each token's flat place in `[B, S]`."""
    n = len(lp)
    max_p, max_r = int(lp.max()), int(lr.max())
    width = max_p + max_r
    lengths = lp + lr
    column = within + (max_p - lp)[seq]
    ids = np.full((n, width), pad_token_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.int64)
    ids[seq, column] = flat
    mask[seq, column] = 1
    labels = np.roll(ids, -1, axis=1)
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    src = rows * width + max_p - 1 + cols
    last = np.arange(n) * width + max_p + lr - 1
    work = (int(lengths.sum()), len(src), float((lengths * lengths / 2).sum()))
    ids_t, labels_t, pos_t, mask_t, *index = host_to_device(
        [ids, labels, pos, mask, src, labels.reshape(-1)[src], rows, cols, last], device)
    return MicroBatch(ids_t, labels_t, pos_t, mask_t, None, None, *index, n, work=work), seq * width + column


class RoutingRecord:
    """One micro-batch's record of its forward's own routing (routing replay R2's old-log-prob pass) on its way to
    the host: the experts each laid-out token ran through in each sparse layer, the whole micro-batch's (a Ulysses
    group's shards gathered, in rank order: the row's order), copied from the device into pinned host memory without
    waiting (an event marks the copy's end: the pass's loop does not wait for the device), and where each row's tokens
    sit in it (`MicroBatch.token_places`). `rows()` waits for the copy and gives each row's experts as
    `build_micro_batch` lays them out again: the inverse of its layouts (padded, packed, prefix-shared: every row
    sharing a prompt gets the record of its one copy; Ulysses shards)."""

    def __init__(self, mb: MicroBatch, record: torch.Tensor):
        flat = record.reshape(-1, *record.shape[-2:])  # [places of this rank's shard, sparse layers, k]
        if mb.sp is not None:
            flat = torch.cat(comm.all_gather(flat, mb.sp.group))
        self.places, self.done = mb.token_places, None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = flat

    def rows(self) -> Ragged:
        """Each row's experts, a `Ragged` of `[tokens of prompt + response, sparse layers, k]` rows."""
        if self.done is not None:
            self.done.synchronize()
        return Ragged(self.host.numpy()[self.places.flat], self.places.offsets)

    @staticmethod
    def join(parts: list[tuple[list[int], RoutingRecord]], n: int) -> Ragged:
        """The experts of rows `0 .. n - 1` from the micro-batches' records (`parts`: each one's rows, as indices
        of the `n`, and its record; every row in one micro-batch; a micro-batch without rows, whose record is its
        placeholder row's, adds none)."""
        return rows_in_order([record.rows()[:len(rows)] for rows, record in parts], [rows for rows, _ in parts], n)


def rows_in_order(pieces: list[Ragged], parts: list[list[int]], n: int) -> Ragged:
    """Rows `0 .. n - 1` from `pieces` (piece k holds the rows `parts[k]`, in that order; each row in one piece)."""
    order = np.concatenate([np.asarray(rows, dtype=np.int64) for rows in parts])
    if not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError(f"rows {np.sort(order).tolist()} given: each of the {n} rows exactly once")
    back = np.empty(n, dtype=np.int64)
    back[order] = np.arange(n)
    return Ragged.concat(pieces).take(back)


def index_on(idx: list[int], device) -> torch.Tensor:
    """Row indices as a device tensor, without waiting for the device (see `host_to_device`)."""
    return host_to_device([np.asarray(idx, dtype=np.int64)], device)[0]


def _place(mb: MicroBatch, selected: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, R]` from the values at the response positions (`mb.src_index` order), 0 elsewhere."""
    return selected.new_zeros(mb.batch_size, width).index_put((mb.dst_row, mb.dst_col), selected)


def _scatter(mb: MicroBatch, flat: torch.Tensor, width: int) -> torch.Tensor:
    return _place(mb, mb.gather(flat.reshape(-1)[mb.src_index]), width)


def response_logprobs(model, mb: MicroBatch, width: int, temperature: float, with_entropy: bool,
                      with_sum_pi_squared: bool = False):
    """(log-probs `[B, R]`, entropy `[B, R]` or None) of the response tokens (only those
    positions go through the LM head); with `with_sum_pi_squared` a third, each token's sum of
    squared probabilities `[B, R]` (forward-only); with `mb.record_routing` a last, the forward's
    `RoutingRecord`."""
    outs = model(mb.input_ids, labels=mb.src_labels, temperature=temperature, with_entropy=with_entropy,
                 label_index=mb.src_index, with_sum_pi_squared=with_sum_pi_squared, **mb.model_kwargs())
    if mb.record_routing:
        outs, record = outs
    logp, ent, *sps = outs
    out = _place(mb, mb.gather(logp), width), (_place(mb, mb.gather(ent), width) if with_entropy else None)
    if with_sum_pi_squared:
        out += (_place(mb, mb.gather(sps[0]), width),)
    return out + (RoutingRecord(mb, record),) if mb.record_routing else out


def response_values(model, mb: MicroBatch, width: int) -> torch.Tensor:
    """Values `[B, R]` of the states before each response token (value-head model)."""
    values = model(mb.input_ids, **mb.model_kwargs())
    return _scatter(mb, values.float(), width)


def last_token_scores(model, mb: MicroBatch) -> torch.Tensor:
    """Value-head output at each sequence's last token `[B]` (reward models)."""
    values = model(mb.input_ids, **mb.model_kwargs())
    scores = mb.gather(values.float().reshape(-1)[mb.last_index], last=True)
    return scores if mb.last_rows is None else torch.empty_like(scores).index_copy_(0, mb.last_rows, scores)
