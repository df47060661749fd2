"""HostStep: one step's chunks turned into host arrays, before the single transfer to the
device. Built in three parts from the same ordered chunks: the packed query tokens
(``pack_tokens``), the KV pool's writes and prefix gathers (``plan_kv``) and which rows
are scored how (``plan_scoring``); for hybrid models a fourth, where each sequence's
linear-attention state comes from and goes (``plan_state``). No torch here.

Chunk order (see ``StepContext``): prefixed chunks first, ordered by the pool blocks they
read (longest first among equals), so the responses of one cached prompt sit side by side
even when prompts share their first blocks; then fresh ones, longest first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from teacher_server.engine.sequence import Chunk

_EMPTY = np.zeros(0, dtype=np.int64)


def _cat(xs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(xs).astype(np.int64, copy=False) if xs else _EMPTY


def _cumsum(xs: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(xs)]).astype(np.int64)


@dataclass
class PackedTokens:
    """The step's query tokens, sequence after sequence."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64 absolute positions
    cu_q: np.ndarray  # [B+1] int64 cumulative query lengths
    cu_k: np.ndarray  # [B+1] int64 cumulative key lengths (prefix + chunk)
    q_lens: list[int]
    k_lens: list[int]


@dataclass
class KvPlan:
    """Where the step's KV goes in the pool, and what earlier KV the prefixed chunks read."""

    write_src: np.ndarray  # [W] int64 token indices (into T) whose KV is written
    write_slots: np.ndarray  # [W] int64 pool slots they go to
    tok_slots: np.ndarray  # [T] int64 pool slot of each token's KV, -1 = not written
    new_pos: np.ndarray  # [Tp] int64 where each prefixed chunk token sits in the packed keys
    prefix_pos: np.ndarray  # [P] int64 where each gathered prefix token sits in them
    prefix_slots: np.ndarray  # [P] int64 pool slots to gather
    total_k: int  # packed keys of the prefixed chunks
    n_prefixed: int  # leading chunks with earlier keys
    prefix_shared: list[int] | None  # see StepContext; None without prefixed chunks
    # Per sliding window w of the model: the keys its layers read, where a prefixed chunk's
    # earliest query is more than w - 1 positions past its first key (absent: all of them)
    windows: dict[int, KvWindow] = field(default_factory=dict)

    @property
    def has_writes(self) -> bool:
        return self.write_src.size > 0


@dataclass
class KvWindow:
    """The keys a layer of window w reads in a step: a prefixed chunk [start, end) needs only
    keys from ``start - (w - 1)`` on (its first query looks back w - 1 positions), so the
    packed keys drop the rest of its cached prefix. Fields as ``KvPlan``'s and ``PackedTokens``'s
    of the same names; fresh chunks' keys are their queries, as there."""

    k_lens: list[int]
    cu_k: np.ndarray  # [B+1] int64
    new_pos: np.ndarray  # [Tp] int64
    prefix_pos: np.ndarray  # [P_w] int64
    prefix_slots: np.ndarray  # [P_w] int64
    total_k: int
    prefix_shared: list[int]


@dataclass
class RowSpan:
    """One chunk's logit rows: [rows_at, rows_at + n_rows) of the step's R rows; its rows
    needing classic prompt_logprobs start at ``plp_at`` of those, its greedy next token is
    entry ``argmax_at`` of the argmax rows."""

    chunk: Chunk
    rows_at: int
    n_rows: int
    plp_at: int
    argmax_at: int


@dataclass
class ScoringLayout:
    """Which hidden rows reach the LM head and what each is scored for; ``spans`` maps the
    results back to the requests (``ModelRunner.scatter_results``)."""

    logits_idx: np.ndarray  # [R] int64 token indices (into T)
    cand: np.ndarray  # [R, kmax] int64, -1 = no candidate
    plp_rows: np.ndarray  # [Rp] int64 ascending rows (into R) needing classic prompt_logprobs
    plp_actual: np.ndarray  # [Rp] int64 the actual next token of each
    plp_k: int  # top-k width of those rows (max over requests)
    argmax_rows: np.ndarray  # [Ra] int64 ascending rows needing the greedy next token
    spans: list[RowSpan]
    # The row targets: per plp row the top-k columns in its tail's set, -1 = no tail asked
    # (None: no row asks); per row the temperature its logits are divided by (None: all 1);
    # whether a request asks for the log normalizer itself (raw_logits mode skips it otherwise).
    tail_k: np.ndarray | None = None  # [Rp] int64
    row_temp: np.ndarray | None = None  # [R] float32
    want_lse: bool = False
    want_rank: bool = False  # a request reads the actual token's rank (classic prompt_logprobs, next_top)

    @property
    def kmax(self) -> int:
        return self.cand.shape[1]


@dataclass
class StatePlan:
    """The linear-attention state slots of the step's sequences (see ``StepContext``)."""

    state_in: np.ndarray  # [B] int64 the slot each sequence starts from (0: the zero state)
    keep: np.ndarray  # [S] int64 sequences (into B) whose end state is kept
    out: np.ndarray  # [S] int64 the slots they go to (never 0)


@dataclass
class HostStep:
    """Host-side arrays of one step, before the single transfer to the device."""

    tokens: PackedTokens
    kv: KvPlan
    scoring: ScoringLayout
    state: StatePlan | None = None  # hybrid models only


def order_chunks(chunks: list[Chunk], block_size: int) -> list[Chunk]:
    def key(c: Chunk) -> tuple:
        if c.start == 0:
            return (1, (), c.start - c.end)
        return (0, tuple(c.seq.block_table[:c.start // block_size]), c.start - c.end)

    return sorted(chunks, key=key)


def shared_keys(a: Chunk, b: Chunk, block_size: int) -> int:
    """Leading keys two prefixed chunks read from the very same pool blocks (a cache hit
    on one prompt), at most both their prefixes."""
    n = min(a.start, b.start)
    ta, tb = a.seq.block_table, b.seq.block_table
    m = 0
    nb = -(-n // block_size)
    while m < nb and ta[m] == tb[m]:
        m += 1
    return min(m * block_size, n)


def pack_tokens(chunks: list[Chunk]) -> PackedTokens:
    q_lens = [c.end - c.start for c in chunks]
    k_lens = [c.end for c in chunks]
    return PackedTokens(
        input_ids=_cat([c.seq.req.token_ids[c.start:c.end] for c in chunks]),
        positions=_cat([np.arange(c.start, c.end, dtype=np.int64) for c in chunks]),
        cu_q=_cumsum(q_lens), cu_k=_cumsum(k_lens), q_lens=q_lens, k_lens=k_lens)


def plan_kv(chunks: list[Chunk], cu_q: np.ndarray, block_size: int, windows: tuple[int, ...] = ()) -> KvPlan:
    """``cu_q``: the packed tokens' offsets (``PackedTokens.cu_q``); ``windows``: the model's
    sliding windows (each gets a ``KvWindow`` where it reads fewer keys than the full layers)."""
    wsrc, wslot = [], []
    for c, q_off in zip(chunks, cu_q.tolist()):
        if c.write_end > c.start:
            wsrc.append(np.arange(q_off, q_off + c.write_end - c.start, dtype=np.int64))
            wslot.append(c.seq.slots(c.start, c.write_end))
    write_src, write_slots = _cat(wsrc), _cat(wslot)
    tok_slots = np.full(int(cu_q[-1]), -1, dtype=np.int64)
    tok_slots[write_src] = write_slots
    n_prefixed = sum(1 for c in chunks if c.start > 0)  # the leading ones (order_chunks)
    pre = chunks[:n_prefixed]
    shared = [0] + [shared_keys(a, b, block_size) for a, b in zip(pre, pre[1:])] if n_prefixed else None
    full = plan_window(chunks, n_prefixed, shared, None)
    plan = KvPlan(write_src=write_src, write_slots=write_slots, tok_slots=tok_slots, new_pos=full.new_pos,
                  prefix_pos=full.prefix_pos, prefix_slots=full.prefix_slots, total_k=full.total_k,
                  n_prefixed=n_prefixed, prefix_shared=shared)
    for w in windows:
        if any(c.start > w - 1 for c in pre):
            plan.windows[w] = plan_window(chunks, n_prefixed, shared, w)
    return plan


def plan_window(chunks: list[Chunk], n_prefixed: int, shared: list[int] | None, window: int | None) -> KvWindow:
    """The keys layers of ``window`` read (None: every key, the full layers' plan): the packed
    ``[prefix from the window on | chunk]`` of each prefixed chunk (``plan_kv``'s chunks,
    prefixed count and sharing)."""
    newpos, ppos, pslot, k_lens, w_shared = [], [], [], [], []
    k_off = prev_skip = 0
    for i, c in enumerate(chunks):
        if i >= n_prefixed:
            k_lens.append(c.end - c.start)
            continue
        skip = 0 if window is None else max(c.start - (window - 1), 0)  # keys before the first query's window
        newpos.append(np.arange(k_off + c.start - skip, k_off + c.end - skip, dtype=np.int64))
        ppos.append(np.arange(k_off, k_off + c.start - skip, dtype=np.int64))
        pslot.append(c.seq.slots(skip, c.start))
        # leading keys read from the same pool entries as the previous chunk's: only where
        # both start at the same position
        w_shared.append(max(shared[i] - skip, 0) if i and skip == prev_skip else 0)
        k_lens.append(c.end - skip)
        k_off += c.end - skip
        prev_skip = skip
    return KvWindow(k_lens=k_lens, cu_k=_cumsum(k_lens), new_pos=_cat(newpos), prefix_pos=_cat(ppos),
                    prefix_slots=_cat(pslot), total_k=k_off, prefix_shared=w_shared)


def plan_scoring(chunks: list[Chunk], cu_q: np.ndarray) -> ScoringLayout:
    """Rows of a chunk: its logit positions [logit_lo, logit_hi), in chunk order; each may be
    scored against candidates, for classic prompt_logprobs, and (the last position) for
    the greedy next token (see ``Chunk``)."""
    lidx, plp_act = [], []
    cand_blocks: list[tuple[int, int, np.ndarray]] = []  # (row offset, n rows, [n, K] or [K])
    plp_rows: list[int] = []
    arg_rows: list[int] = []
    tail_k: list[np.ndarray] = []
    temps: list[tuple[int, int, float]] = []  # (row offset, n rows, temperature) where not 1
    any_tail = want_lse = want_rank = False
    spans = []
    r_off = kmax = plp_k = 0
    for c, q_off in zip(chunks, cu_q.tolist()):
        req = c.seq.req
        lo, hi = c.logit_lo, c.logit_hi
        nr = max(hi - lo, 0)
        spans.append(RowSpan(c, r_off, nr, len(plp_rows), len(arg_rows)))
        if not nr:
            continue
        lidx.append(np.arange(q_off + lo - c.start, q_off + hi - c.start, dtype=np.int64))
        if req.candidates is not None:
            kmax = max(kmax, req.k)
        a, b = c.cand_positions()
        if b > a:
            block = req.candidates[a - req.start:b - req.start] if req.per_row else req.candidates
            cand_blocks.append((r_off + a - lo, b - a, block))
        a, b = c.plp_positions()
        if b > a:
            plp_k = max(plp_k, req.plp_width)
            plp_rows.extend(range(r_off, r_off + b - a))
            act = req.token_ids[a + 1:b + 1]
            # the last position (``next_top``) has no actual token: any id fills its slot
            plp_act.append(act if act.size == b - a else np.append(act, 0))
            tail_k.append(np.full(b - a, req.top_k if req.tail else -1, dtype=np.int64))
            any_tail |= req.tail
            want_lse |= req.logsumexp
            want_rank |= req.plp_cols is not None
        if req.temperature != 1.0:
            temps.append((r_off, nr, req.temperature))
        if c.has_next_token:
            arg_rows.append(r_off + hi - 1 - lo)
        r_off += nr
    cand = np.full((r_off, kmax), -1, dtype=np.int64)
    for off, n, block in cand_blocks:
        cand[off:off + n, :block.shape[-1]] = block
    row_temp = None
    if temps:
        row_temp = np.ones(r_off, dtype=np.float32)
        for off, n, t in temps:
            row_temp[off:off + n] = t
    return ScoringLayout(logits_idx=_cat(lidx), cand=cand, plp_rows=np.asarray(plp_rows, dtype=np.int64),
                         plp_actual=_cat(plp_act), plp_k=plp_k, argmax_rows=np.asarray(arg_rows, dtype=np.int64),
                         spans=spans, tail_k=_cat(tail_k) if any_tail else None, row_temp=row_temp,
                         want_lse=want_lse, want_rank=want_rank)


def plan_state(chunks: list[Chunk]) -> StatePlan:
    """Each chunk's state slots (``Chunk.state_in`` / ``state_out``) in step order."""
    keep = [i for i, c in enumerate(chunks) if c.state_out]
    return StatePlan(state_in=np.asarray([c.state_in for c in chunks], dtype=np.int64),
                     keep=np.asarray(keep, dtype=np.int64),
                     out=np.asarray([chunks[i].state_out for i in keep], dtype=np.int64))


def build_host_step(chunks: list[Chunk], block_size: int, linear_state: bool = False,
                    windows: tuple[int, ...] = ()) -> HostStep:
    """``linear_state``: the model has linear-attention layers (the step gets a ``StatePlan``);
    ``windows``: its sliding windows (see ``plan_kv``)."""
    chunks = order_chunks(chunks, block_size)
    tokens = pack_tokens(chunks)
    return HostStep(tokens, plan_kv(chunks, tokens.cu_q, block_size, windows), plan_scoring(chunks, tokens.cu_q),
                    plan_state(chunks) if linear_state else None)
