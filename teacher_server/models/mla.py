"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight).

Per token (shapes per rank; n = this rank's heads, widths of DeepSeek-V3):
- q: ``q_proj(h)``, or ``q_b_proj(rms(q_a_proj(h)))`` with a low rank (q_lora_rank) ->
  [T, n, 192] = 128 dims without position | 64 rotated;
- the latent: ``kv_a_proj_with_mqa(h)`` -> 512 (RMS-normed) | 64 (the one rotated key every
  head shares): 576 numbers, which is all the KV pool keeps per token and layer (the cache
  kind ``latent``, one "head" of 576, replicated on every rank);
- keys and values of each head from the latent: ``kv_b_proj(latent[:512])`` -> per head
  k_nope 128 | v 128; key = k_nope | the shared rotated 64 (192), value 128.

A step's keys and values are made ("expanded") from the latent: the step's own tokens' and,
for sequences after a cached prefix or earlier chunks, the gathered prefix latents' (the
expanded form: one GEMM over the prefix; the absorbed form, q times kv_b_proj's key half
against the latent, pays off when queries are few per key, i.e. decoding, not a prefill).

q_a_proj and kv_a_proj_with_mqa take the same input: one fused GEMM (``qkv_a_proj``),
held whole on every rank (its output is small); q/q_b_proj and kv_b_proj are split by heads
(column-parallel), o_proj by its input columns (row-parallel).

Rotary: DeepSeek's checkpoints rotate (x0, x1), (x2, x3), ... pairs (``rope_interleave``,
V2 always); the rows of the rotated dims are permuted at load to (x0, x2, ..., x1, x3, ...),
after which the usual half-split rotation gives the same dot products, at no cost per step.
YaRN's ``mscale_all_dim`` scales the softmax (``softmax_scale``).

Values narrower than keys go to backends that take them (``distinct_v_width``); others get
v padded with zeros to the key width and the output's extra columns dropped. A backend that
also ``takes_views`` gets q rotated where its projection wrote it (only the 64 rotated dims
read and written) and v as a view of kv_b_proj's output (no copy), keys alone assembled.
"""

from __future__ import annotations

import math

import torch

from teacher_server.attention.base import AttentionInputs
from teacher_server.cache_layout import LATENT, AttentionCache, AttentionParams
from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import MergedColumnLinear, RowLinear
from teacher_server.layers.norm import RMSNorm
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.runtime import RuntimeModule
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.mla_prep import rotate_q_in_place
from teacher_server.ops.qkv_rope import HeadLayout
from teacher_server.ops.slack import alloc_with_slack
from teacher_server.step_context import StepContext
from teacher_server.unsupported import UnsupportedModelError

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepSeek builds them with the default eps


def softmax_scale(spec: ModelSpec) -> float:
    """qk_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (the non-rotary dims
    are scaled too, as DeepSeek's reference and transformers' ``yarn_apply_mscale`` do)."""
    scale = spec.head_dim ** -0.5
    rs = spec.rope_scaling
    m_all = rs.get("mscale_all_dim")
    factor = float(rs.get("factor") or 1.0)
    if rs.get("rope_type", "default") != "default" and m_all and factor > 1:
        m = 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def rope_permutation(width: int) -> torch.Tensor:
    """Rows (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): interleaved pairs to halves."""
    return torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])


class RopeRowsLinear(MergedColumnLinear):
    """A column-parallel projection whose parts hold rotated rows in DeepSeek's interleaved
    order, permuted to halves as they load. ``rope_rows[part] = (unit, first, width)``: in
    every ``unit`` rows of the part, rows [first, first + width) are rotated. (A slice of
    whole units, as a rank reads it, permutes alike.)"""

    def __init__(self, *args: object, rope_rows: dict[str, tuple[int, int, int]], interleaved: bool,
                 **kw: object) -> None:
        super().__init__(*args, **kw)
        self.rope_rows = rope_rows if interleaved else {}
        scheme = getattr(self.fmt, "scheme", None)  # the block rows of a block-scaled format, else 0
        self.block_rows = r = scheme.block[0] if getattr(scheme, "weights", None) == "block" else 0
        for part, (unit, first, width) in self.rope_rows.items() if r else ():
            start, n = self.sources[part]  # a block's scale stays right only if no block holds rotated and other rows
            for s in range(start + first, start + n, unit):
                if s // r != (s + width - 1) // r:  # (the permutation moves rows across the whole span)
                    raise UnsupportedModelError(
                        f"{part} rows: the {r}-row weight blocks of the FP8 checkpoint cut a head's {width} "
                        f"rotated rows (rows {s}-{s + width - 1}), which load permuted: not supported (blocks "
                        f"that hold each head's rotated rows whole, as DeepSeek's 128, are)")

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        where = self.rope_rows.get(part)
        # The weight's rows, and a per-row scale's ([N, 1]) with them; a block-wise scale is left as it
        # is: each head's rotated rows lie in one block (checked when the layer is built).
        per_row = loaded.dim() == 2 and loaded.shape[1] == 1 and not self.block_rows  # (not one column of blocks)
        if where is not None and (param == "weight" or per_row):
            unit, first, width = where
            assert loaded.shape[0] % unit == 0, f"{name}: {loaded.shape[0]} rows are not whole units of {unit}"
            raw = loaded.view(torch.uint8) if loaded.element_size() == 1 else loaded  # (fp8: index the bytes)
            rows = raw.view(-1, unit, *raw.shape[1:]).clone()
            rows[:, first:first + width] = rows[:, first + rope_permutation(width)]
            loaded = rows.view(raw.shape).view(loaded.dtype)
        super().load_weight(param, loaded, part, name)


class MlaAttention(RuntimeModule):
    """Returns the attention output [T, n * v_head_dim]; ``o_proj`` is applied by the decoder
    layer (fused with the residual add)."""

    rope_key = "default"

    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        m = self.mla = spec.mla
        assert m is not None, f"{spec.architecture} has no latent attention dims"
        self.layer_id = layer_id
        self.n = tp.split(spec.num_heads, "attention heads")
        hidden, heads, qk, il = spec.hidden_size, spec.num_heads, m.qk_dim, m.rope_interleave
        # The fused-QKV stage's layout at the rotary width (the start-up checks of the shared stages).
        self.heads = HeadLayout(self.n, self.n, m.qk_rope_head_dim, spec.rms_norm_eps)
        self.params = AttentionParams(softmax_scale(spec))
        q_rope = (qk, m.qk_nope_head_dim, m.qk_rope_head_dim)  # per head: the last 64 of 192 rows rotate
        # q without a low rank, whole on this rank (tp 1: Moonlight, V2-Lite): q and kv_a in one GEMM, q's
        # checkpoint tensor loading as its "q_a" part (``DeepseekForCausalLM.checkpoint_param``)
        self.q_in_a = not m.q_lora_rank and tp.size == 1
        a_parts = {"q_a": m.q_lora_rank or heads * qk} if m.q_lora_rank or self.q_in_a else {}
        a_parts["kv_a"] = m.latent
        rope = {"kv_a": (m.latent, m.kv_lora_rank, m.qk_rope_head_dim), **({"q_a": q_rope} if self.q_in_a else {})}
        # q_a and kv_a: one GEMM, whole on every rank
        self.qkv_a_proj = RopeRowsLinear(hidden, a_parts, False, dtype, device, SINGLE, fmt=fmt, rope_rows=rope,
                                         interleaved=il)
        self.q_proj = self.q_a_layernorm = self.q_b_proj = None
        if m.q_lora_rank:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = RopeRowsLinear(m.q_lora_rank, {"q": heads * qk}, False, dtype, device, tp,
                                           units={"q": qk}, fmt=fmt, rope_rows={"q": q_rope}, interleaved=il)
        elif not self.q_in_a:
            self.q_proj = RopeRowsLinear(hidden, {"q": heads * qk}, False, dtype, device, tp, units={"q": qk},
                                         fmt=fmt, rope_rows={"q": q_rope}, interleaved=il)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        kv = m.qk_nope_head_dim + m.v_head_dim
        self.kv_b_proj = MergedColumnLinear(m.kv_lora_rank, {"kv": heads * kv}, False, dtype, device, tp,
                                            units={"kv": kv}, fmt=fmt)
        self.o_proj = RowLinear(heads * m.v_head_dim, hidden, dtype, device, tp, fmt)

    def cache(self) -> AttentionCache:
        """What this layer keeps per token: the 576-wide latent (one head, no separate values);
        attention sees n heads of keys 192 and values 128 made from it."""
        m = self.mla
        q_row = self.n * m.qk_dim + (m.latent if self.q_in_a else 0)  # (q_in_a: q is the a-projection's first part)
        kv = m.qk_nope_head_dim + m.v_head_dim
        return AttentionCache(self.layer_id, LATENT, 1, m.latent, 0, self.params, q_heads=self.n,
                              expands_to=(self.n, m.qk_dim, m.v_head_dim),
                              views=((q_row, m.qk_dim, 1), (self.n * kv, kv, 1)))

    def qk_norm_weights(self) -> tuple[None, None]:
        return None, None

    def expand(self, latent: torch.Tensor, pad_v: bool, front: bool, first: int = 0,
               views: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [N, n, 192] and values [N, n, 128] (or zero-padded to 192) of latents [N, 576],
        each in a buffer with slack rows (the cuDNN backends pad into them). Rows before
        ``first`` are zeros, not made: the step's prefixed tokens, whose keys attention reads
        from the packed prefix keys instead. ``views`` (and no such rows): the values are
        kv_b_proj's output where it wrote them (a strided view, no copy)."""
        m, n, t = self.mla, self.n, latent.shape[0]
        src = latent[first:]
        kv = self.kv_b_proj(src[:, :m.kv_lora_rank]).view(t - first, n, m.qk_nope_head_dim + m.v_head_dim)
        k = alloc_with_slack(latent, t, n, m.qk_dim, front=front)
        if views and not first and not pad_v:
            self.rt.ops.mla_expand(kv, src[:, m.kv_lora_rank:], k, None)
            return k, kv[..., m.qk_nope_head_dim:]
        v = alloc_with_slack(latent, t, n, m.qk_dim if pad_v else m.v_head_dim, front=front)
        if first:
            k[:first].zero_()
            v[:first].zero_()
        self.rt.ops.mla_expand(kv, src[:, m.kv_lora_rank:], k[first:], v[first:])
        if pad_v:
            v[first:, :, m.v_head_dim:].zero_()
        return k, v

    def forward(self, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h: normed input [T, hidden]; cs: the step's rotary rows [T, qk_rope_head_dim]."""
        rt, m, n, t = self.rt, self.mla, self.n, h.shape[0]
        a = self.qkv_a_proj(h)  # [T, (q_lora or q +) 576]
        pad_v = not rt.attn.distinct_v_width
        views = rt.attn.takes_views and not pad_v
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(a[:, :m.q_lora_rank]))
        else:
            q = None if self.q_in_a and views else a[:, :n * m.qk_dim] if self.q_in_a else self.q_proj(h)
        # the latent the pool keeps (normed | rotated shared key) and q rotated (views: where it is, q None: in a)
        args = (a, None if q is None else q.view(t, n, m.qk_dim), cs, self.kv_a_layernorm.weight, LATENT_NORM_EPS,
                m.kv_lora_rank)
        latent, q = rotate_q_in_place(rt.ops.mla_prep, *args, n) if views else rt.ops.mla_prep(*args)
        one = latent.view(t, 1, m.latent)
        rt.kv.store(self.layer_id, one, one, ctx)
        k, v = self.expand(latent, pad_v, front=True, first=ctx.tok_prefixed, views=views)
        kp = vp = None
        if ctx.has_prefix:  # packed [cached prefix | chunk] latents of the prefixed sequences, expanded
            lp, _ = rt.kv.gather_prefixed(self.layer_id, one, one, ctx)
            kp, vp = self.expand(lp.view(-1, m.latent), pad_v, front=False, views=views)
        p = self.params
        o = rt.attn(AttentionInputs(q, k, v, kp, vp), ctx, p.scale, None)  # [T, n, v width]
        if pad_v:
            o = o[..., :m.v_head_dim]
        return o.reshape(t, n * m.v_head_dim)
