"""ModelRunner: owns the model, the KV pool tensors and the attention backend; turns a
step's chunks into one StepContext (one host-to-device copy), runs the forward and the
scoring stage, and copies results back into each request's result arrays."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from teacher_server.attention.base import AttentionBackend
from teacher_server.engine.scoring import ScoringOutput, ScoringPlan, score_rows
from teacher_server.engine.sequence import Chunk
from teacher_server.kv_pool import KVPool
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.layers.runtime import Runtime
from teacher_server.model.context import LaunchPacer, StepContext
from teacher_server.ops.fused import FusedOps

log = logging.getLogger(__name__)


@dataclass
class HostStep:
    """Host-side arrays of one step, before the single transfer to the device."""

    ints: dict[str, np.ndarray]  # name -> int64 array; concatenated into one buffer
    q_lens: list[int]
    k_lens: list[int]
    total_k: int  # packed keys of the prefixed sequences
    n_prefixed: int  # leading sequences with earlier keys
    has_writes: bool
    kmax: int
    plp_k: int
    # per chunk: (chunk, rows offset in R, number of logit rows, offset into plp rows, offset into argmax rows)
    layout: list[tuple[Chunk, int, int, int, int]]
    plp_rows: np.ndarray
    argmax_rows: np.ndarray
    prefix_shared: list[int] | None = None  # see StepContext


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


@dataclass
class PendingOutput:
    """A launched step's results: host tensors, valid once ``done`` has completed."""

    out: ScoringOutput
    done: torch.cuda.Event | None  # None: already complete (CPU)
    mid: torch.cuda.Event | None = None  # recorded half-way through the forward
    paced_s: float = 0.0  # host time the launch spent waiting on its own earlier layers
    start: torch.cuda.Event | None = None  # recorded before the step's first kernel (timing)
    hook_s: float = 0.0  # host time in the launch's on_first_wait (completing the previous step)
    idle_gaps: list = field(default_factory=list)  # (from, to) events: the GPU waited for the host

    def wait_half(self) -> None:
        """Block (without the GIL) until the step's forward is half done."""
        if self.mid is not None:
            self.mid.synchronize()


class ModelRunner:
    def __init__(self, model: nn.Module, attn: AttentionBackend, num_blocks: int, block_size: int,
                 max_model_len: int, device: torch.device, logits_mode: bool, logits_chunk_rows: int,
                 compile_ops: bool = True) -> None:
        self.model = model
        self.spec = spec = model.spec
        self.device = device
        self.block_size = block_size
        self.logits_mode = logits_mode
        self.chunk_rows = logits_chunk_rows
        self.run_ahead = 6  # layers the host may queue ahead of the GPU within a forward
        dtype, cuda = model.dtype, device.type == "cuda"
        self.kv = KVPool(spec.num_layers, num_blocks * block_size, spec.num_kv_heads, spec.head_dim, dtype, device)
        rope = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings,
                               max_model_len + 1, device)
        if cuda:  # cuDNN plans for every bucketed length
            attn.warm_up(max_model_len, spec.num_heads, spec.num_kv_heads, spec.head_dim, device, dtype)
        # Our CUDA kernels on CUDA; torch.compile where configured (each falls back alone).
        self.ops = FusedOps(kernels=cuda, compile=compile_ops and cuda)
        if cuda:
            model.warm_up_ops(self.ops, rope)
        model.bind(Runtime(attn, self.ops, self.kv, rope))

    @property
    def attn(self) -> AttentionBackend:
        """The attention backend the model runs (assigning it switches every layer's)."""
        return self.model.rt.attn

    @attn.setter
    def attn(self, backend: AttentionBackend) -> None:
        self.model.rt.attn = backend

    # --- prepare ---------------------------------------------------------------------
    def prepare(self, chunks: list[Chunk]) -> HostStep:
        ids, pos, wsrc, wslot, newpos, ppos, pslot, lidx = [], [], [], [], [], [], [], []
        cand_blocks: list[tuple[int, int, np.ndarray]] = []  # (row offset, n rows, [n, K] or [K])
        plp_rows, plp_act, arg_rows = [], [], []
        q_lens, k_lens, layout = [], [], []
        q_off = k_off = r_off = 0
        kmax = plp_k = 0
        # Prefixed sequences first, in the order of the pool blocks they read (longest first
        # among equals), so the responses of one cached prompt sit side by side even when
        # prompts share their first blocks; then fresh ones, longest first (see StepContext).
        def order(c: Chunk) -> tuple:
            if c.start == 0:
                return (1, (), c.start - c.end)
            return (0, tuple(c.seq.block_table[:c.start // self.block_size]), c.start - c.end)

        chunks = sorted(chunks, key=order)
        n_prefixed = sum(1 for c in chunks if c.start > 0)
        shared = [0] + [shared_keys(a, b, self.block_size) for a, b in zip(chunks[:n_prefixed - 1], chunks[1:n_prefixed])]
        for c in chunks:
            seq, req = c.seq, c.seq.req
            toks = req.token_ids
            n = c.end - c.start
            ids.append(toks[c.start:c.end])
            pos.append(np.arange(c.start, c.end, dtype=np.int64))
            q_lens.append(n)
            k_lens.append(c.end)
            if c.write_end > c.start:
                wsrc.append(np.arange(q_off, q_off + c.write_end - c.start, dtype=np.int64))
                wslot.append(seq.slots(c.start, c.write_end))
            if c.start > 0:
                newpos.append(np.arange(k_off + c.start, k_off + c.end, dtype=np.int64))
                ppos.append(np.arange(k_off, k_off + c.start, dtype=np.int64))
                pslot.append(seq.slots(0, c.start))
                k_off += c.end
            lo, hi = c.logit_lo, c.logit_hi
            nr = max(hi - lo, 0)
            p_off, a_off = len(plp_rows), len(arg_rows)
            if nr:
                lidx.append(np.arange(q_off + lo - c.start, q_off + hi - c.start, dtype=np.int64))
                if req.candidates is not None:
                    kmax = max(kmax, req.k)
                a, b = c.cand_positions()
                if b > a:
                    block = req.candidates[a - req.start:b - req.start] if req.per_row else req.candidates
                    cand_blocks.append((r_off + a - lo, b - a, block))
                a, b = c.plp_positions()
                if b > a:
                    plp_k = max(plp_k, req.prompt_logprobs)
                    plp_rows.extend(range(r_off, r_off + b - a))
                    plp_act.append(toks[a + 1:b + 1])
                if c.has_next_token:
                    arg_rows.append(r_off + hi - 1 - lo)
            layout.append((c, r_off, nr, p_off, a_off))
            q_off += n
            r_off += nr
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
        write_src, write_slots = cat(wsrc), cat(wslot)
        tok_slots = np.full(q_off, -1, dtype=np.int64)
        tok_slots[write_src] = write_slots
        cand = np.full((r_off, kmax), -1, dtype=np.int64)
        for off, n, block in cand_blocks:
            cand[off:off + n, :block.shape[-1]] = block
        ints = {
            "input_ids": cat(ids).astype(np.int64, copy=False),
            "positions": cat(pos),
            "cu_q": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64),
            "cu_k": np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int64),
            "write_src": write_src,
            "write_slots": write_slots,
            "tok_slots": tok_slots,
            "new_pos": cat(newpos),
            "prefix_pos": cat(ppos),
            "prefix_slots": cat(pslot),
            "logits_idx": cat(lidx),
            "cand": cand.reshape(-1),
            "plp_rows": np.asarray(plp_rows, dtype=np.int64),
            "plp_actual": cat(plp_act).astype(np.int64, copy=False),
            "argmax_rows": np.asarray(arg_rows, dtype=np.int64),
        }
        return HostStep(ints, q_lens, k_lens, k_off, n_prefixed, bool(wsrc), kmax, plp_k, layout,
                        ints["plp_rows"], ints["argmax_rows"], shared if n_prefixed else None)

    # --- execute ---------------------------------------------------------------------
    def execute(self, hs: HostStep, pacer: LaunchPacer | None = None) -> ScoringOutput:
        names = list(hs.ints)
        sizes = [hs.ints[n].size for n in names]
        flat = torch.from_numpy(np.concatenate([hs.ints[n] for n in names]))
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        parts = dict(zip(names, torch.split(flat, sizes)))
        ctx = StepContext(
            input_ids=parts["input_ids"], positions=parts["positions"],
            cu_q=parts["cu_q"].to(torch.int32), cu_k=parts["cu_k"].to(torch.int32),
            max_q=max(hs.q_lens), max_k=max(hs.k_lens), q_lens=hs.q_lens, k_lens=hs.k_lens,
            write_src=parts["write_src"] if hs.has_writes else None,
            write_slots=parts["write_slots"] if hs.has_writes else None,
            tok_slots=parts["tok_slots"] if hs.has_writes else None,
            new_pos=parts["new_pos"] if hs.n_prefixed else None,
            prefix_pos=parts["prefix_pos"] if hs.n_prefixed else None,
            prefix_slots=parts["prefix_slots"] if hs.n_prefixed else None,
            total_k=hs.total_k, logits_idx=parts["logits_idx"],
            n_prefixed=hs.n_prefixed, tok_prefixed=sum(hs.q_lens[:hs.n_prefixed]),
            prefix_shared=hs.prefix_shared, pacer=pacer,
        )
        hidden = self.model(ctx, pacer)  # [R, H]
        plan = ScoringPlan(
            cand=parts["cand"].view(-1, hs.kmax) if hs.kmax else parts["cand"].view(0, 0),
            kmax=hs.kmax,
            plp_rows=parts["plp_rows"] if hs.plp_rows.size else None,
            plp_actual=parts["plp_actual"] if hs.plp_rows.size else None,
            plp_k=hs.plp_k,
            argmax_rows=parts["argmax_rows"] if hs.argmax_rows.size else None,
            plp_rows_host=hs.plp_rows, argmax_rows_host=hs.argmax_rows,
        )
        return score_rows(hidden, self.model.lm_head, plan, self.logits_mode, self.chunk_rows)

    def launch(self, hs: HostStep, on_first_wait: Callable[[], None] | None = None) -> PendingOutput:
        """Run the step and queue the copies of its results to pinned host memory; on CUDA
        this returns as soon as the work is queued (``collect`` waits for it). On CUDA,
        ``on_first_wait`` runs when the launch first has to wait for the GPU (``LaunchPacer``);
        it may never run."""
        if self.device.type != "cuda":
            return PendingOutput(self.execute(hs), None)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        pacer = LaunchPacer(self.run_ahead, on_first_wait)
        out = self.execute(hs, pacer)
        host = {}
        for name in ScoringOutput.__dataclass_fields__:
            t = getattr(out, name)
            if t is not None:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t = h
            host[name] = t
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        return PendingOutput(ScoringOutput(**host), done, pacer.mid, pacer.wait_s, start, pacer.hook_s,
                             pacer.idle_gaps)

    @staticmethod
    def collect(p: PendingOutput) -> ScoringOutput:
        """Wait until a launched step's results are on the host."""
        if p.done is not None:
            p.done.synchronize()
        return p.out

    # --- results ---------------------------------------------------------------------
    @staticmethod
    def scatter_results(hs: HostStep, out: ScoringOutput) -> None:
        """Copy one step's host results into the requests' arrays."""
        to_np = lambda t: None if t is None else t.numpy()  # noqa: E731
        scores, pa, pr, tv, ti, am = map(to_np, (out.scores, out.plp_actual, out.plp_rank,
                                                 out.plp_topk_vals, out.plp_topk_ids, out.argmax))
        for c, r_off, nr, p_off, a_off in hs.layout:
            req, res = c.seq.req, c.seq.result
            if nr == 0:
                continue
            lo = c.logit_lo
            a, b = c.cand_positions()
            if b > a:
                res.token_id_logprobs[a - req.start:b - req.start] = scores[r_off + a - lo:r_off + b - lo, :req.k]
            a, b = c.plp_positions()
            if b > a:
                sl = slice(p_off, p_off + b - a)
                res.plp_token_logprob[a:b] = pa[sl]
                res.plp_token_rank[a:b] = pr[sl]
                res.plp_topk_logprobs[a:b] = tv[sl, :req.prompt_logprobs]
                res.plp_topk_ids[a:b] = ti[sl, :req.prompt_logprobs]
            if c.has_next_token:
                res.next_token = int(am[a_off])
