"""Engine state as small dataclasses: one `Sequence` per sample, one `ScheduledBatch` per step.

Token ids that are not yet known on the host are `PLACEHOLDER`: the engine schedules step
t+1 before it has read step t's sampled tokens back from the GPU (a decoding sequence takes
its input token from a device buffer), and fills the values in when it processes step t.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

PLACEHOLDER = -1
_M32 = 0xFFFFFFFF


def mix32(x: int) -> int:
    """A 32-bit integer hash (Chris Wellons' lowbias32); the sampler applies the same one on the device."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def derive_seed(seed: int, *parts: int) -> int:
    """The seed of a sub-stream of `seed` (a rollout replica, a validation chunk): a 32-bit hash of
    (seed, *parts) with `mix32`. Unlike `seed + part`, neighbouring seeds' sub-streams do not coincide."""
    h = mix32((seed & _M32) ^ mix32(seed >> 32))
    for p in parts:
        h = mix32(h ^ mix32(p + 0x27D4EB2F))
    return h


def sequence_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The sampler key of one sample: a 32-bit hash of (seed, prompt index, sample index)."""
    h = mix32((seed & _M32) ^ mix32(seed >> 32))
    h = mix32(h ^ mix32(prompt_index + 0x9E3779B9))
    return mix32(h ^ mix32(sample_index + 0x85EBCA6B))


class SeqStatus(enum.Enum):
    WAITING = 0  # queued for (re)admission: a new prompt or a preempted sequence to recompute
    RUNNING = 1  # holds KV blocks and a slot; prefilling or decoding
    FINISHED = 2  # scheduled its last token (or stopped): holds nothing


@dataclass(eq=False)
class Sequence:
    """One sample of one prompt.

    `token_ids` holds prompt + response; `num_computed_tokens` of them have their K/V in the
    cache. A prompt with `num_samples = n > 1` is prefilled once; when its last chunk is
    scheduled it forks `n - 1` siblings that share its KV blocks (copy-on-write).
    """

    seq_id: int
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_len: int  # prompt + max new tokens, capped at max_model_len
    seed: int = 0
    num_samples: int = 1  # samples still to fork from this sequence's prefill (n for a fresh prompt)
    stop_token_ids: frozenset[int] = frozenset()
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    prefilling: bool = False  # admitted, last prefill chunk not yet scheduled
    block_table: list[int] = field(default_factory=list)
    slot: int = -1  # row of the engine's per-sequence device tables (block table, last token)
    reserved_slots: list[int] = field(default_factory=list)  # slots kept for the siblings to fork
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # set when the last token's value is known: "stop" | "length"
    # (EngineConfig.return_routed_experts) the device copy of its tokens' recorded experts, taken when it gave its
    # blocks back (`ModelRunner.routed_experts_of`)
    routed_experts: object = None

    def __post_init__(self):
        self.key = sequence_key(self.seed, self.prompt_index, self.sample_index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class ScheduledBatch:
    """The work of one engine step.

    `seqs[i]` computes tokens `[starts[i], starts[i] + chunk_lens[i])` of its `token_ids`, in
    device slot `slots[i]` (recorded here: a sequence that ends in this step gives its slot back
    before the step runs).
    The rows that decode (one token of a sequence past its prompt) are the last
    `num_decode_rows` of `seqs`: all of a decode step's, and in a prefill step the decoding
    sequences that ride along with the prompt chunks.
    Sampler row r gives `sample_seqs[r]` its token number `sample_positions[r]` (an index
    into token_ids) from the logits of the last token of `seqs[sample_src[r]]`; forked
    siblings share their parent's row source; `sample_slots[r]` is the row's slot. Before the forward, `copies` (src, dst)
    duplicate KV blocks (copy-on-write) and `block_table_updates` (slot, column, block)
    are applied to the device block table.
    """

    is_prefill: bool
    seqs: list[Sequence] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    chunk_lens: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_slots: list[int] = field(default_factory=list)
    sample_src: list[int] = field(default_factory=list)
    sample_positions: list[int] = field(default_factory=list)
    block_table_updates: list[tuple[int, int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_decode_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_lens)
