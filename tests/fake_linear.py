"""A stand-in linear-attention layer, to run the engine's state routing end to end on the CPU
without a real hybrid family: ``hybrid_engine`` builds an engine on a dense checkpoint whose
chosen layers' attention is replaced by ``FakeLinearMixer``. The mixer honours the state
contract of ``StepContext`` (start from ``state_in``, keep end states in ``state_out``) the
way a Gated DeltaNet layer must, so any mistake in which state a chunk starts from changes
the scores."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from teacher_server.cache_layout import LinearStateLayout
from teacher_server.config import Config
from teacher_server.engine import rank_setup
from teacher_server.engine.engine import Engine
from teacher_server.layers.runtime import RuntimeModule
from teacher_server.models.spec import ModelSpec
from teacher_server.step_context import StepContext

KERNEL = 3
DECAY = 0.9
_FROM_DIR, _LOAD_MODEL = ModelSpec.from_dir, rank_setup.load_model  # before any test patches them


class FakeLinearMixer(RuntimeModule):
    """In place of a layer's attention (same projections): a depthwise causal convolution
    (kernel ``KERNEL``) over the qkv projection, SiLU, then per KV head a decaying sum of
    outer products k v^T read by q. Convolution state: the last KERNEL - 1 projected rows
    [KERNEL - 1, width]; recurrent state: [kv heads, d, d] float32."""

    def __init__(self, attn: torch.nn.Module, layer_id: int) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj, self.layer_id = attn.qkv_proj, attn.o_proj, layer_id
        hd = attn.heads
        self.n_q, self.n_kv, self.d = hd.n_q, hd.n_kv, hd.d
        self.width = (hd.n_q + 2 * hd.n_kv) * hd.d
        g = torch.Generator().manual_seed(layer_id)
        self.conv_w = torch.nn.Parameter(torch.randn(KERNEL, self.width, generator=g) / KERNEL, requires_grad=False)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(convolution, recurrent) state shapes of one slot."""
        return (KERNEL - 1, self.width), (self.n_kv, self.d, self.d)

    def forward(self, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.qkv_proj(h)  # [T, width]
        pool = self.rt.kv
        conv, rec = pool.conv_state(self.layer_id), pool.rec_state(self.layer_id)
        c0, r0 = conv[ctx.state_in], rec[ctx.state_in]  # gathered (copies) before any end state is written
        cu = ctx.cu_q.tolist()
        outs, end_c, end_r = [], [], []
        for b in range(len(cu) - 1):
            xb = x[cu[b]:cu[b + 1]]
            n = xb.shape[0]
            xx = torch.cat([c0[b].to(x.dtype), xb])  # [KERNEL - 1 + n, width]
            y = F.silu(sum(self.conv_w[j] * xx[j:j + n] for j in range(KERNEL)))
            end_c.append(xx[-(KERNEL - 1):])
            q, k, v = y.split([self.n_q * self.d, self.n_kv * self.d, self.n_kv * self.d], dim=-1)
            q = q.view(n, self.n_kv, -1, self.d)[:, :, 0].float()  # the first query head of each group
            k = F.normalize(k.view(n, self.n_kv, self.d).float(), dim=-1)
            v = v.view(n, self.n_kv, self.d).float()
            s = r0[b]
            o = []
            for t in range(n):
                s = DECAY * s + k[t, :, :, None] * v[t, :, None, :]  # [kv heads, d, d]
                o.append(torch.einsum("hi,hij->hj", q[t], s))
            end_r.append(s)
            o = torch.stack(o).to(x.dtype)  # [n, kv heads, d]
            outs.append(o.repeat_interleave(self.n_q // self.n_kv, dim=1).reshape(n, -1))  # [n, q heads * d]
        if ctx.state_keep is not None:
            conv[ctx.state_out] = torch.stack(end_c)[ctx.state_keep].to(conv.dtype)
            rec[ctx.state_out] = torch.stack(end_r)[ctx.state_keep]
        return torch.cat(outs)


def hybrid_engine(monkeypatch, path, linear: tuple[int, ...], **cfg: object) -> Engine:
    """An engine on the dense checkpoint ``path`` whose layers ``linear`` are FakeLinearMixers
    (the spec says they are linear layers, so they get no KV)."""
    def from_dir(p) -> ModelSpec:
        spec = _FROM_DIR(p)
        types = tuple("linear_attention" if i in linear else "full_attention" for i in range(spec.num_layers))
        return dataclasses.replace(spec, layer_types=types)

    def load_model(*args: object, **kw: object) -> torch.nn.Module:
        model = _LOAD_MODEL(*args, **kw)
        mixers = {}
        for i in linear:
            mixers[i] = FakeLinearMixer(model.layers[i].self_attn, i)
            model.layers[i].self_attn = mixers[i]
        conv, rec = mixers[linear[0]].state_shapes()
        layout = LinearStateLayout(layers=linear, conv_shape=conv, rec_shape=rec, conv_dtype=model.dtype)
        model.linear_state_layout = lambda: layout
        return model

    monkeypatch.setattr(ModelSpec, "from_dir", staticmethod(from_dir))
    monkeypatch.setattr(rank_setup, "load_model", load_model)
    return Engine(Config(device="cpu", **cfg))
