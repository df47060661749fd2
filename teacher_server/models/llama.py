"""The Llama decoder, also serving Mistral (sliding window) and Qwen2 (QKV bias).

Weights are fused (QKV, gate/up). The forward takes a step's packed varlen tokens and its
StepContext; the KV of the step's tokens goes to the paged pool where the scheduler asked
for it, and keys of earlier chunks / cached prefixes are gathered from it. Only the hidden
rows listed in ``ctx.logits_idx`` are returned (final-normed)."""

from __future__ import annotations

import re

import torch
from torch import nn

from teacher_server.attention.base import AttentionInputs
from teacher_server.cache_layout import FULL, SLIDING, AttentionCache, AttentionParams, CacheLayout, LinearStateLayout
from teacher_server.layers.activation import SiluAndMul
from teacher_server.layers.embedding import LMHead, VocabEmbedding, VocabRows
from teacher_server.layers.formats import make_format
from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import MergedColumnLinear, RowLinear
from teacher_server.layers.norm import RMSNorm
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.pipeline import WHOLE, PipelineStage, StageLayers
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.layers.runtime import RuntimeModule
from teacher_server.models.base import LayerPacer
from teacher_server.models.norm import add_norm, decoder_norm
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.qkv_rope import HeadLayout
from teacher_server.step_context import StepContext


class LlamaAttention(RuntimeModule):
    """Fused QKV projection, rotary (and the KV-pool write), attention over the step's and
    the pool's keys. Returns the attention output [T, q heads * head_dim]; the o projection is
    applied by the decoder layer (fused with the residual add)."""

    q_rows_per_head = 1  # rows of the q part per head and head dim: 2 where q_proj also makes an output gate
    rope_key = "default"  # which of the model's rotary tables (``make_ropes``) rotates q and k

    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        d, g = spec.head_dim, self.q_rows_per_head
        # Tensor parallel splits heads; with more ranks than KV heads each is replicated.
        self.heads = HeadLayout(*tp.heads(spec.num_heads, spec.num_kv_heads), d, spec.rms_norm_eps)
        self.layer_id = layer_id
        self.params = AttentionParams(d ** -0.5, spec.layer_window(layer_id))
        parts = {"q": g * spec.q_size, "k": spec.kv_size, "v": spec.kv_size}
        self.qkv_proj = MergedColumnLinear(spec.hidden_size, parts, spec.attention_bias, dtype, device, tp,
                                           units={"q": g * d, "k": d, "v": d}, fmt=fmt)
        self.o_proj = RowLinear(spec.q_size, spec.hidden_size, dtype, device, tp, fmt)

    @property
    def scale(self) -> float:
        return self.params.scale

    @property
    def window(self) -> int | None:
        return self.params.window

    def cache(self) -> AttentionCache:
        """What this layer keeps per token: its KV heads' keys and values, full or sliding."""
        hd = self.heads
        return AttentionCache(self.layer_id, FULL if self.params.window is None else SLIDING, hd.n_kv, hd.d, hd.d,
                              self.params, q_heads=hd.n_q)

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-head RMSNorm weights of q and k ([head_dim] each), None when the family has none."""
        return None, None

    def forward(self, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h: normed input [T, hidden]; cs: the step's rotary rows [T, head_dim]."""
        rt = self.rt
        qkv = self.qkv_proj(h)  # [T, (n_q + 2 n_kv) d]
        q, k, v = rt.ops.qkv_store(qkv, cs, self.heads, *self.qk_norm_weights(), rt.kv, self.layer_id, ctx)
        return self.attend(q, k, v, ctx).reshape(q.shape[0], -1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q over the step's keys and values and the prefixed ones' [cached prefix | chunk]: [T, Hq, D]
        (a sliding layer's cached prefix from its window on: ``StepContext.for_window``)."""
        p = self.params
        ctx = ctx.for_window(p.window)
        kp, vp = self.rt.kv.gather_prefixed(self.layer_id, k, v, ctx) if ctx.has_prefix else (None, None)
        return self.rt.attn(AttentionInputs(q, k, v, kp, vp, sinks), ctx, p.scale, p.window, p.softcap)


class LlamaMLP(RuntimeModule):
    """Fused gate/up projection and SiLU-mul: [T, hidden] -> [T, intermediate]; the down
    projection is applied by the decoder layer (fused with the residual add)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE,
                 fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        i = spec.intermediate_size
        self.gate_up_proj = MergedColumnLinear(spec.hidden_size, {"gate": i, "up": i}, False, dtype, device, tp,
                                               fmt=fmt)
        self.act = SiluAndMul()
        self.down_proj = RowLinear(i, spec.hidden_size, dtype, device, tp, fmt)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> the down projection's input [T, intermediate] (an FP8 down projection's
        quantized in the SiLU-mul pass: ``WeightFormat.silu_mul_input``)."""
        p, d = self.gate_up_proj, self.down_proj
        w = p.fmt.dense(p)  # [2I, H]; None: the format holds no plain weight for the fused kernel
        a = self.rt.ops.gate_up_act(h, w) if w is not None and p.bias is None else None  # one kernel where it runs
        if a is not None:
            return a
        gate_up = p(h)
        # (a product in row parts, tp_comm_parts > 1, slices a plain tensor)
        a = d.fmt.silu_mul_input(d, gate_up) if d.tp.comm_parts == 1 else None
        return a if a is not None else self.act(gate_up)


def residual_norm(x: torch.Tensor, a: torch.Tensor, proj: RowLinear, norm: RMSNorm | None, ops: FusedOps,
                  reader: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + proj(a) (the new residual stream) and its RMSNorm with ``norm`` (None: no norm,
    the last layer of a pipeline stage before the last: ``add_norm``). With
    ``residual_in_gemm`` the sum is made in the GEMM's epilogue, in place, and rounded once,
    instead of rounding proj(a) and then the sum; it saves a full pass over [T, hidden] (a format
    without that epilogue, FP8, hands proj(a) to the norm's pass as ``delta``: one pass fewer too).
    ``reader``: the one linear layer that reads the normed rows, where its weight format takes
    them made in the norm's pass (FP8: quantized there, ``WeightFormat.norm_input``)."""
    fused = reader is not None and type(norm) is RMSNorm and ops.fp8_norm_input
    if ops.residual_in_gemm and proj.fmt.epilogue_add(proj):
        x = proj.add_into(x, a)
        got = reader.fmt.norm_input(reader, x, norm.weight, norm.eps) if fused else None
        return got if got is not None else (x, None if norm is None else ops.rms_norm(x, norm.weight, norm.eps))
    return add_norm(x, proj(a), norm, ops, reader)


def input_reader(layer: nn.Module) -> nn.Module | None:
    """The linear layer that alone reads ``layer``'s normed input (its attention's fused q/k/v
    projection), where the decoder and attention forwards are this module's own; else None."""
    attn = getattr(layer, "self_attn", None)
    if type(layer).forward is not LlamaDecoderLayer.forward or attn is None or layer.mixer is not attn \
            or type(attn).forward is not LlamaAttention.forward:
        return None
    return attn.qkv_proj


class LlamaDecoderLayer(RuntimeModule):
    def __init__(self, spec: ModelSpec, layer_id: int, attention: type[LlamaAttention], dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.input_layernorm = decoder_norm(spec, spec.hidden_size, dtype, device)
        self.self_attn = attention(spec, layer_id, dtype, device, tp, fmt)
        self.post_attention_layernorm = decoder_norm(spec, spec.hidden_size, dtype, device)
        self.mlp = self.make_mlp(spec, layer_id, dtype, device, tp, fmt)
        self.next_norm: RMSNorm | None = None  # the next layer's input norm, the final norm, or None at a stage's end
        self.next_reader: nn.Module | None = None  # the linear layer alone reading next_norm's rows: set by the model

    def make_mlp(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel, fmt: WeightFormat) -> nn.Module:
        """The layer's feed-forward block (expert families put their expert layer here)."""
        return LlamaMLP(spec, dtype, device, tp, fmt)

    def mlp_residual(self, x: torch.Tensor, h: torch.Tensor, ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x + mlp(h) and its norm with ``next_norm`` (None without one)."""
        return residual_norm(x, self.mlp(h), self.mlp.down_proj, self.next_norm, ops, self.next_reader)

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: attention here; it returns [T, q width] for ``o_proj``."""
        return self.self_attn

    def forward(self, x: torch.Tensor, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: residual stream [T, hidden]; h: this layer's normed input. Returns the new
        residual stream and the next layer's normed input (``next_norm``'s; None without one).
        ``keep`` ([R] indices into T): only those rows go past the mixer, and the results
        are [R, hidden] in ``keep``'s order. The mixer still sees every row (its keys, values
        and states are kept for later chunks and cached prefixes)."""
        ops, mixer = self.rt.ops, self.mixer
        a = mixer(h, cs, ctx)  # [T, q width]
        if keep is not None:
            x, a = x[keep], a[keep]
        reader = self.mlp.gate_up_proj if type(self.mlp) is LlamaMLP else None
        x, h = residual_norm(x, a, mixer.o_proj, self.post_attention_layernorm, ops, reader)
        return self.mlp_residual(x, h, ops)


class LlamaForCausalLM(RuntimeModule):
    """The decoder: embedding, layers, final norm, LM head (tied to the embedding or not).
    Built with random-free empty weights; ``loader`` fills them, ``bind`` attaches the
    collaborators, then ``model(ctx, pacer)`` runs a step."""

    attention: type[LlamaAttention] = LlamaAttention
    decoder_layer: type[nn.Module] = LlamaDecoderLayer  # (spec, layer_id, attention, dtype, device, tp, fmt)
    embedding: type[VocabEmbedding] = VocabEmbedding  # (Gemma scales its rows)
    # Checkpoint names (after "model.") whose tensors are parts of our fused projections.
    stacked: tuple[tuple[str, str, str], ...] = (
        (".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", "gate"), (".up_proj.", ".gate_up_proj.", "up"),
    )
    ignored = re.compile(r"rotary_emb\.inv_freq$")
    # After the last layer's mixer only the rows that reach the LM head are computed (its
    # o projection, MLP and norms): the rest would be thrown away. Off: every row, then the
    # selection (the benchmark's ablation; fixed under tensor parallel, where every rank's
    # all-reduce must have the same rows).
    last_layer_rows_only: bool = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, tied: bool,
                 tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        self.spec = spec
        self.tied = tied
        self.tp = tp
        self.stage = stage  # pipeline parallel: this rank's layers, embedding (first stage), head (last)
        self._dtype = dtype
        # How every weight-holding layer stores its weights, decided once by the spec.
        self.weight_format = fmt = make_format(spec.weight_format, spec.quantization_config).accumulating(
            spec.fp8_fast_accum)
        # the embedding on the first stage, and on the last where it is the (tied) LM head
        embeds = stage.first or (tied and stage.last)
        self.embed_tokens = (self.embedding(spec.vocab_size, spec.hidden_size, dtype, device, tp, fmt) if embeds
                             else None)
        made = {i: self.decoder_layer(spec, i, self.attention, dtype, device, tp, fmt)
                for i in stage.layers(spec.num_layers)}
        self.layers = nn.ModuleList(made.values()) if stage.size == 1 else StageLayers(made)
        self.norm = decoder_norm(spec, spec.hidden_size, dtype, device) if stage.last else None
        self.head = None if tied or not stage.last else LMHead(spec.vocab_size, spec.hidden_size, dtype, device, tp,
                                                               fmt)
        # A stage before the last ends on a layer whose next norm lives on the next stage: that
        # layer only adds to the residual stream (no norm: ``self.norm`` is None there) and the
        # next stage norms what it receives with its first layer's input norm.
        nexts = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        # (the LM head, and the next stage, read plain rows)
        readers = [input_reader(layer) for layer in self.layers[1:]] + [None]
        for layer, norm, reader in zip(self.layers, nexts, readers):
            # References, not children: the norm and the reader belong to the next layer (or the model).
            object.__setattr__(layer, "next_norm", norm)
            object.__setattr__(layer, "next_reader", reader)

    @property
    def logits_layer(self) -> VocabRows | None:
        """The layer that makes the logits: the LM head, or the embedding when tied (with
        tp > 1 its rows from ``vocab_start``); None on a pipeline stage before the last."""
        if not self.stage.last:
            return None
        return self.embed_tokens if self.head is None else self.head

    @property
    def lm_head(self) -> torch.Tensor | None:
        """The plain LM head weight [V, hidden] (None where the format holds none, and on a
        pipeline stage before the last): for tests and tools; scoring asks ``logits_layer``."""
        head = self.logits_layer
        return None if head is None else head.fmt.dense(head)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def linear_state_layout(self) -> LinearStateLayout | None:
        """The per-sequence state of this rank's linear-attention layers (None: every layer
        is attention with paged KV)."""
        return None

    def cache_layout(self) -> CacheLayout:
        """What this rank keeps per token (each attention layer's ``cache()``) and per
        sequence (``linear_state_layout``): the KV pool, the memory plan and the attention
        backend's checks are made from it."""
        caches = tuple(layer.mixer.cache() for layer in self.layers if isinstance(layer.mixer, LlamaAttention))
        return CacheLayout(caches, self.dtype, self.linear_state_layout())

    def make_ropes(self, max_len: int, device: torch.device) -> dict[str, RotaryEmbedding]:
        """The rotary tables of this model's attention layers (keyed by their ``rope_key``),
        for positions below max_len: one here, at the rotary width (head_dim, or its first part
        for partial rotary); a family whose layer kinds rotate differently makes one per kind."""
        s = self.spec
        return {"default": RotaryEmbedding(s.rotary_dim, s.rope_theta, s.rope_scaling, s.max_position_embeddings,
                                           max_len, device)}

    def checkpoint_param(self, hf_name: str) -> tuple[str, str, str | None] | None:
        """Where a checkpoint tensor goes: (module path, parameter, fused part or None), or None
        when it is not loaded (rotary buffers; the LM head of a tied model)."""
        if self.ignored.search(hf_name):
            return None
        if hf_name == "lm_head.weight":
            return None if self.head is None else ("head", "weight", None)
        name, part = hf_name.removeprefix("model."), None
        for theirs, ours, p in self.stacked:
            if theirs in name:
                name, part = name.replace(theirs, ours), p
                break
        module, _, param = name.rpartition(".")
        return module, param, part

    def on_stage(self, module: str) -> bool:
        """Whether this rank's pipeline stage holds the module at path ``module`` (a checkpoint
        tensor's place, ``checkpoint_param``): the loader skips the other stages' tensors."""
        if self.stage.size == 1:
            return True
        top, _, rest = module.partition(".")
        if top == "layers":
            layer = rest.partition(".")[0]
            return layer.isdigit() and int(layer) in self.stage.layers(self.spec.num_layers)
        if top == "embed_tokens":
            return self.embed_tokens is not None
        if top == "norm":
            return self.norm is not None
        return True

    def warm_up_ops(self, ops: FusedOps, ropes: dict[str, RotaryEmbedding]) -> None:
        """Compile and check ``ops``' stages at this model's shapes and q/k-norm weights."""
        attn = self.layers[0].self_attn
        # a dense MLP's width, this rank's share (an MoE model may have none: its experts are
        # checked at their own width by the MoE warm-up)
        dense = next((layer.mlp for layer in self.layers if hasattr(layer.mlp, "gate_up_proj")), None)
        inter = dense.gate_up_proj.parts["gate"][1] if dense is not None else self.spec.intermediate_size
        table = ropes[attn.rope_key].table
        ops.warm_up(attn.heads, self.spec.hidden_size, inter, *attn.qk_norm_weights(), table, table.device, self.dtype)

    @torch.inference_mode()
    def forward(self, ctx: StepContext, pacer: LayerPacer | None = None) -> torch.Tensor:
        """Returns the final-normed hidden states of the rows in ctx.logits_idx: [R, hidden]."""
        rt = self.rt
        assert rt is not None, "bind() the model's collaborators before its first forward"
        st = self.stage
        if st.first:
            x = self.embed_tokens(ctx.input_ids)  # [T, hidden]
        else:  # the residual stream the previous stage made
            x = st.recv(ctx.input_ids.shape[0], self.spec.hidden_size, self.dtype, ctx.input_ids.device)
        css = {key: rope(ctx.positions) for key, rope in rt.ropes.items()}  # each [T, D] float32: cos | sin halves
        h = self.layers[0].input_layernorm(x)
        # the last layer's rows past its mixer (the model's last layer: on the last stage)
        keep = ctx.logits_idx if self.last_layer_rows_only and st.last else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if pacer is not None:
                pacer.before_layer(i)
            cs = css[getattr(layer.mixer, "rope_key", "default")]
            if i < last or keep is None:
                x, h = layer(x, h, cs, ctx)
            elif keep.numel() == 0:  # nothing reaches the head: the last mixer's keys, values and states only
                layer.mixer(h, cs, ctx)
                h = x[:0]  # (h may be the mixer's quantized input: an empty plain tensor instead)
            else:
                x, h = layer(x, h, cs, ctx, keep)
            if pacer is not None:
                pacer.after_layer()
        if not st.last:
            st.send(x, self.dtype)
            return x[:0]  # nothing reaches the LM head on this stage
        return h if keep is not None else h[ctx.logits_idx]  # [R, hidden]
