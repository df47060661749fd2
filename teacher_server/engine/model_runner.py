"""ModelRunner: owns the model, the KV pool tensors and the attention backend; turns a
step's host arrays (``HostStep``) into one StepContext (one host-to-device copy), runs the
forward and the scoring stage, and copies results back into each request's result arrays."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from teacher_server.attention.base import AttentionBackend
from teacher_server.engine.host_step import HostStep, ScoringLayout, build_host_step
from teacher_server.engine.pacer import Pacer
from teacher_server.engine.scoring import ScoringOutput, ScoringPlan, score_rows
from teacher_server.engine.sequence import Chunk
from teacher_server.kv_pool import KVPool
from teacher_server.layers.runtime import Runtime
from teacher_server.models.base import TeacherModel
from teacher_server.ops.fused import FusedOps
from teacher_server.step_context import StepContext

log = logging.getLogger(__name__)


@dataclass
class PendingOutput:
    """A launched step's results: host tensors, valid once ``pacer.wait_done()`` returned."""

    out: ScoringOutput
    pacer: Pacer  # the launch's pacer: its events (half way, done) and GPU timeline


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 host arrays -> device tensors in ONE copy (pinned, non-blocking on CUDA)."""
    flat = torch.from_numpy(np.concatenate(arrays))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(torch.split(flat, [a.size for a in arrays]))


class ModelRunner:
    def __init__(self, model: TeacherModel, attn: AttentionBackend, num_blocks: int, block_size: int,
                 max_model_len: int, device: torch.device, logits_mode: bool, logits_chunk_rows: int,
                 compile_ops: bool = True, state_slots: int = 0, step_tokens: int | None = None) -> None:
        """``state_slots``: linear-attention state slots of a hybrid model, the zero slot
        excluded (see ``KVPool``); ``step_tokens``: the token budget of a step, the longest a
        fresh sequence's attention call can be (the attention plans built at start-up go up to
        it; None: max_model_len)."""
        self.model = model
        self.spec = model.spec
        self.device = device
        self.block_size = block_size
        self.logits_mode = logits_mode
        self.chunk_rows = logits_chunk_rows
        cuda = device.type == "cuda"
        self.tp = model.tp
        layout = model.cache_layout()  # what each layer keeps, this rank's heads
        self.kv = KVPool(num_blocks * block_size, layout, device,
                         state_slots=state_slots + 1 if layout.state is not None else 0)
        # a hybrid model's steps carry state slots, also to a pipeline stage whose layers keep none
        self.plans_state = bool(model.spec.linear_layer_ids)
        # the model's sliding windows (every stage's: the host step travels to all ranks)
        spec = model.spec
        self.windows = tuple(sorted({w for i in spec.kv_layer_ids if (w := spec.layer_window(i)) is not None}))
        ropes = model.make_ropes(max_model_len + 1, device)
        self.startup_s: dict[str, float] = {}  # seconds of the start-up's one-time work, by phase (the log line)
        t0 = time.perf_counter()
        if cuda and layout.attention:  # cuDNN plans for every bucketed length a fresh sequence's call can have
            c = layout.widest()
            hkv, dk, dv = c.attn_shape  # a latent layer's backend shape is its expanded heads'
            attn.warm_up(min(max_model_len, step_tokens or max_model_len), c.q_heads or c.heads, hkv, dk,
                         device, layout.dtype, layers=len(layout.attention), dv=dv if attn.distinct_v_width else dk,
                         views=c.views if attn.takes_views else None)
            self.startup_s["attention plans"] = time.perf_counter() - t0
        # Our CUDA kernels on CUDA; torch.compile where configured (each falls back alone).
        self.ops = FusedOps(kernels=cuda, compile=compile_ops and cuda)
        if cuda:
            t0 = time.perf_counter()
            model.warm_up_ops(self.ops, ropes)
            self.startup_s["compiles and autotuning"] = time.perf_counter() - t0
        model.bind(Runtime(attn, self.ops, self.kv, ropes))

    def set_tuning(self, residual_in_gemm: bool, last_layer_rows_only: bool) -> None:
        """The switches of the forward that may change between runs (``engine.tuning``)."""
        self.ops.use_residual_in_gemm(residual_in_gemm)
        self.model.last_layer_rows_only = last_layer_rows_only

    @property
    def attn(self) -> AttentionBackend:
        """The attention backend the model runs (assigning it switches every layer's)."""
        return self.model.rt.attn

    @attn.setter
    def attn(self, backend: AttentionBackend) -> None:
        why = backend.refusal(self.kv.layout.params())  # the model's windows and soft-caps
        if why is not None:
            raise ValueError(why)
        self.model.rt.attn = backend

    # --- prepare ---------------------------------------------------------------------
    def prepare(self, chunks: list[Chunk]) -> HostStep:
        """The step's host arrays: packed tokens, KV plan, scoring layout."""
        return build_host_step(chunks, self.block_size, self.plans_state, self.windows)

    # --- execute ---------------------------------------------------------------------
    def execute(self, hs: HostStep, pacer: Pacer) -> ScoringOutput | None:
        """Run the forward and the scoring stage of one step (queued on CUDA); a pipeline
        stage before the last runs its layers only and hands the residual stream on (None)."""
        tok, kv, sc, st = hs.tokens, hs.kv, hs.scoring, hs.state
        arrays = [tok.input_ids, tok.positions, tok.cu_q, tok.cu_k, kv.write_src, kv.write_slots, kv.tok_slots,
                  kv.new_pos, kv.prefix_pos, kv.prefix_slots, sc.logits_idx, sc.cand.reshape(-1), sc.plp_rows,
                  sc.plp_actual, sc.argmax_rows]
        if sc.tail_k is not None:  # the row targets' tail sets travel in the same copy
            arrays.append(sc.tail_k)
        if st is not None:  # hybrid models: the state slots travel in the same copy
            arrays += [st.state_in, st.keep, st.out]
        wins = list(kv.windows.items())  # the sliding layers' keys, in the same copy
        for _, kw in wins:
            arrays += [kw.cu_k, kw.new_pos, kw.prefix_pos, kw.prefix_slots]
        (input_ids, positions, cu_q, cu_k, write_src, write_slots, tok_slots, new_pos, prefix_pos, prefix_slots,
         logits_idx, cand, plp_rows, plp_actual, argmax_rows, *rest) = to_device(arrays, self.device)
        tail_k = rest.pop(0) if sc.tail_k is not None else None
        state = rest[:3] if st is not None else []
        win_arrays = rest[len(state):]
        writes, prefixed = kv.has_writes, kv.n_prefixed > 0
        ctx = StepContext(
            input_ids=input_ids, positions=positions, cu_q=cu_q.to(torch.int32), cu_k=cu_k.to(torch.int32),
            max_q=max(tok.q_lens), max_k=max(tok.k_lens), q_lens=tok.q_lens, k_lens=tok.k_lens,
            logits_idx=logits_idx,
            write_src=write_src if writes else None, write_slots=write_slots if writes else None,
            tok_slots=tok_slots if writes else None,
            new_pos=new_pos if prefixed else None, prefix_pos=prefix_pos if prefixed else None,
            prefix_slots=prefix_slots if prefixed else None,
            total_k=kv.total_k, n_prefixed=kv.n_prefixed, tok_prefixed=sum(tok.q_lens[:kv.n_prefixed]),
            prefix_shared=kv.prefix_shared,
        )
        if st is not None:
            ctx.state_in, ctx.state_in_host = state[0], st.state_in.tolist()
            if st.keep.size:
                ctx.state_keep, ctx.state_out, ctx.state_keep_host = state[1], state[2], st.keep.tolist()
        for i, (w, kw) in enumerate(wins):
            ck, npos, ppos, pslot = win_arrays[4 * i:4 * i + 4]
            ctx.windows[w] = replace(ctx, cu_k=ck.to(torch.int32), max_k=max(kw.k_lens), k_lens=kw.k_lens,
                                     new_pos=npos, prefix_pos=ppos, prefix_slots=pslot, total_k=kw.total_k,
                                     prefix_shared=kw.prefix_shared, windows={})
        hidden = self.model(ctx, pacer)  # [R, H]
        if not self.model.stage.last:
            return None
        n_plp, n_arg = sc.plp_rows.size, sc.argmax_rows.size
        plan = ScoringPlan(
            cand=cand.view(-1, sc.kmax) if sc.kmax else cand.view(0, 0), kmax=sc.kmax,
            plp_rows=plp_rows if n_plp else None, plp_actual=plp_actual if n_plp else None, plp_k=sc.plp_k,
            argmax_rows=argmax_rows if n_arg else None,
            plp_rows_host=sc.plp_rows, argmax_rows_host=sc.argmax_rows, tail_k=tail_k,
            row_temp=None if sc.row_temp is None else torch.from_numpy(sc.row_temp).to(self.device),
            want_lse=sc.want_lse, want_rank=sc.want_rank,
        )
        return score_rows(hidden, self.model.logits_layer, plan, self.logits_mode, self.chunk_rows, self.tp)

    def launch(self, hs: HostStep, pacer: Pacer) -> PendingOutput:
        """Run the step and queue the copies of its results to pinned host memory; on CUDA
        this returns as soon as the work is queued (``collect`` waits for it). ``pacer``
        paces the forward and records the step's events (``LaunchPacer``; ``Unpaced`` on
        the CPU)."""
        pacer.begin()
        out = self.execute(hs, pacer)
        if self.device.type == "cuda":
            host = {}
            for f in fields(ScoringOutput):
                t = getattr(out, f.name)
                if t is not None:
                    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    h.copy_(t, non_blocking=True)
                    t = h
                host[f.name] = t
            out = ScoringOutput(**host)
        pacer.end()
        return PendingOutput(out, pacer)

    @staticmethod
    def collect(p: PendingOutput) -> ScoringOutput:
        """Wait until a launched step's results are on the host."""
        p.pacer.wait_done()
        return p.out

    # --- results ---------------------------------------------------------------------
    @staticmethod
    def scatter_results(layout: ScoringLayout, out: ScoringOutput) -> None:
        """Copy one step's host results into the requests' arrays."""
        to_np = lambda t: None if t is None else t.numpy()  # noqa: E731
        scores, pa, pr, tv, ti, am, lse, tail = map(to_np, (out.scores, out.plp_actual, out.plp_rank,
                                                           out.plp_topk_vals, out.plp_topk_ids, out.argmax,
                                                           out.plp_lse, out.plp_tail))
        for span in layout.spans:
            c = span.chunk
            req, res = c.seq.req, c.seq.result
            if span.n_rows == 0:
                continue
            lo, r_off = c.logit_lo, span.rows_at
            a, b = c.cand_positions()
            if b > a:
                res.token_id_logprobs[a - req.start:b - req.start] = scores[r_off + a - lo:r_off + b - lo, :req.k]
            a, b = c.plp_positions()
            if b > a:
                sl = slice(span.plp_at, span.plp_at + b - a)
                if res.plp_token_logprob is not None:
                    k = req.plp_cols
                    res.plp_token_logprob[a:b] = pa[sl]
                    res.plp_token_rank[a:b] = pr[sl]
                    res.plp_topk_logprobs[a:b] = tv[sl, :k]
                    res.plp_topk_ids[a:b] = ti[sl, :k]
                # the row targets: positions [start, L-1), row = position - start
                lo_t, hi_t = max(a, req.start), min(b, req.length - 1)
                if hi_t > lo_t and req.row_targets:
                    ts = slice(span.plp_at + lo_t - a, span.plp_at + hi_t - a)
                    rs = slice(lo_t - req.start, hi_t - req.start)
                    if req.top_k:
                        res.topk_ids[rs] = ti[ts, :req.top_k]
                        res.topk_logprobs[rs] = tv[ts, :req.top_k]
                    for name, wanted, src in (("actual_logprobs", req.actual, pa), ("tail_logprobs", req.tail, tail),
                                              ("logsumexp", req.logsumexp, lse)):
                        if wanted:
                            getattr(res, name)[rs] = src[ts]
            if c.has_next_token:
                res.next_token = int(am[span.argmax_at])
