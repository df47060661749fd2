"""ModelRunner: owns the model, the KV pool tensors and the attention backend; turns a
step's host arrays (``HostStep``) into one StepContext (one host-to-device copy), runs the
forward and the scoring stage, and copies results back into each request's result arrays."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import numpy as np
import torch

from teacher_server.engine.host_step import HostStep, ScoringLayout, build_host_step
from teacher_server.engine.pacer import Pacer
from teacher_server.engine.scoring import ScoringOutput, ScoringPlan, score_rows
from teacher_server.engine.sequence import Chunk
from teacher_server.model.attention import AttentionBackend
from teacher_server.model.decoder import DecoderModel
from teacher_server.model.fused import FusedOps
from teacher_server.model.rope import cos_sin_table
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
    def __init__(self, model: DecoderModel, attn: AttentionBackend, num_blocks: int, block_size: int,
                 max_model_len: int, device: torch.device, logits_mode: bool, logits_chunk_rows: int,
                 compile_ops: bool = True) -> None:
        self.model = model
        self.spec = model.spec
        self.attn = attn
        self.device = device
        self.block_size = block_size
        self.logits_mode = logits_mode
        self.chunk_rows = logits_chunk_rows
        dtype = model.embed.dtype
        self.cos_sin = cos_sin_table(self.spec, max_model_len + 1, device)  # [len, D] float32
        slots = num_blocks * block_size
        # One allocation: [layers, 2 (k/v), slots, kv_heads, head_dim]
        self.kv = torch.empty(self.spec.num_layers, 2, slots, self.spec.num_kv_heads, self.spec.head_dim,
                              dtype=dtype, device=device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(self.spec.num_layers)]
        if hasattr(attn, "warm_up") and device.type == "cuda":  # cuDNN plans for every bucketed length
            secs = attn.warm_up(max_model_len, self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim,
                                device, dtype)
            log.info("attention warm-up: %d cuDNN shapes in %.1fs", len(attn.shapes), secs)
        self.ops = FusedOps(enable_compile=compile_ops and device.type == "cuda")
        if self.ops.compiled:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile the fused stages now (two token counts: a static then a dynamic graph) and
        check each against its eager version on random inputs; fall back to eager on failure."""
        t0 = time.perf_counter()
        s, dt, dev = self.spec, self.model.embed.dtype, self.device
        eager = FusedOps(False)
        try:
            for n in (16, 40):
                x = torch.randn(n, s.hidden_size, device=dev, dtype=dt)
                w = 1 + 0.1 * torch.randn(s.hidden_size, device=dev, dtype=dt)
                gu = torch.randn(n, 2 * s.intermediate_size, device=dev, dtype=dt)
                qkv = torch.randn(n, s.q_size + 2 * s.kv_size, device=dev, dtype=dt)
                cs = self.cos_sin[(torch.arange(n, device=dev) * 37) % self.cos_sin.shape[0]]
                half = s.head_dim // 2
                cos, sin = cs[:, None, :half], cs[:, None, half:]
                qn = self.model.layers[0].q_norm
                kn = self.model.layers[0].k_norm
                args = {
                    "rms_norm": (x, w, s.rms_norm_eps),
                    "add_rms_norm": (x, x.flip(0), w, s.rms_norm_eps),
                    "silu_mul": (gu,),
                    "qkv_prep": (qkv, cos, sin, qn, kn, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps),
                }
                for name, a in args.items():
                    got, ref = getattr(self.ops, name)(*a), getattr(eager, name)(*a)
                    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
                        err = (g.float() - r.float()).abs().max().item()
                        bound = 1e-2 * r.float().abs().max().item() + 1e-3
                        if not err <= bound:
                            raise RuntimeError(f"compiled {name} differs from eager by {err:.3g} (bound {bound:.3g})")
            log.info("compiled fused elementwise stages in %.1fs", time.perf_counter() - t0)
        except Exception as e:
            self.ops.fallback(e)
            return
        try:
            self._check_qkv_kernel(eager)
        except Exception as e:  # the torch stages are correct, only slower
            log.warning("fused QKV kernel disabled: %s", e)
            self.ops.qkv_kernel = False

    def _check_qkv_kernel(self, eager: FusedOps) -> None:
        """The fused QKV/rotary/KV-write kernel against the torch stages, pool writes included."""
        from types import SimpleNamespace

        s, dt, dev = self.spec, self.model.embed.dtype, self.device
        n = 40
        qkv = torch.randn(n, s.q_size + 2 * s.kv_size, device=dev, dtype=dt)
        cs = self.cos_sin[(torch.arange(n, device=dev) * 37) % self.cos_sin.shape[0]]
        slots = torch.arange(n, device=dev) * 2
        slots[::3] = -1  # some tokens are not written
        keep = slots >= 0
        ctx = SimpleNamespace(tok_slots=slots, write_slots=slots[keep], write_src=torch.arange(n, device=dev)[keep])
        layer = self.model.layers[0]
        res = []
        for ops in (self.ops, eager):
            kc = torch.zeros(2 * n, s.num_kv_heads, s.head_dim, device=dev, dtype=dt)
            vc = torch.zeros_like(kc)
            q, k, v = ops.qkv_store(qkv, cs, layer.q_norm, layer.k_norm, s.num_heads, s.num_kv_heads, s.head_dim,
                                    s.rms_norm_eps, kc, vc, ctx)
            res.append((q, k, v, kc, vc))
        for name, g, r in zip(("q", "k", "v", "k_cache", "v_cache"), *res):
            err = (g.float() - r.float()).abs().max().item()
            if not err <= 1e-2 * r.float().abs().max().item() + 1e-3:
                raise RuntimeError(f"{name} differs from the torch stages by {err:.3g}")

    # --- prepare ---------------------------------------------------------------------
    def prepare(self, chunks: list[Chunk]) -> HostStep:
        """The step's host arrays: packed tokens, KV plan, scoring layout."""
        return build_host_step(chunks, self.block_size)

    # --- execute ---------------------------------------------------------------------
    def execute(self, hs: HostStep, pacer: Pacer) -> ScoringOutput:
        """Run the forward and the scoring stage of one step (queued on CUDA)."""
        tok, kv, sc = hs.tokens, hs.kv, hs.scoring
        (input_ids, positions, cu_q, cu_k, write_src, write_slots, tok_slots, new_pos, prefix_pos, prefix_slots,
         logits_idx, cand, plp_rows, plp_actual, argmax_rows) = to_device(
            [tok.input_ids, tok.positions, tok.cu_q, tok.cu_k, kv.write_src, kv.write_slots, kv.tok_slots,
             kv.new_pos, kv.prefix_pos, kv.prefix_slots, sc.logits_idx, sc.cand.reshape(-1), sc.plp_rows,
             sc.plp_actual, sc.argmax_rows], self.device)
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
        hidden = self.model(ctx, self.cos_sin, self.kv_caches, self.attn, self.ops, pacer)  # [R, H]
        n_plp, n_arg = sc.plp_rows.size, sc.argmax_rows.size
        plan = ScoringPlan(
            cand=cand.view(-1, sc.kmax) if sc.kmax else cand.view(0, 0), kmax=sc.kmax,
            plp_rows=plp_rows if n_plp else None, plp_actual=plp_actual if n_plp else None, plp_k=sc.plp_k,
            argmax_rows=argmax_rows if n_arg else None,
            plp_rows_host=sc.plp_rows, argmax_rows_host=sc.argmax_rows,
        )
        return score_rows(hidden, self.model.lm_head, plan, self.logits_mode, self.chunk_rows)

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
        scores, pa, pr, tv, ti, am = map(to_np, (out.scores, out.plp_actual, out.plp_rank,
                                                 out.plp_topk_vals, out.plp_topk_ids, out.argmax))
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
                res.plp_token_logprob[a:b] = pa[sl]
                res.plp_token_rank[a:b] = pr[sl]
                res.plp_topk_logprobs[a:b] = tv[sl, :req.prompt_logprobs]
                res.plp_topk_ids[a:b] = ti[sl, :req.prompt_logprobs]
            if c.has_next_token:
                res.next_token = int(am[span.argmax_at])
