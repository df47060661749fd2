"""gather_logprobs: per row, log-softmax over the vocabulary (float32) gathered at K
candidate ids; negative candidates (``-1`` padding) give ``-inf``.

CUDA tensors go through the kernel in ``kernels/gather_logprob.cu`` (``ops.extension``);
CPU tensors, and CUDA ones when the kernel cannot be built, use the torch reference.
``python -m teacher_server.ops.gather_logprob`` builds the kernels ahead of time (as
``python -m teacher_server.ops.extension`` does).
"""

from __future__ import annotations

import sys

import torch

from teacher_server.ops import extension

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CAND_DTYPES = (torch.int32, torch.int64)


def gather_logprobs_reference(logits: torch.Tensor, cand: torch.Tensor, logits_mode: bool = False) -> torch.Tensor:
    """logits: [R, V] float32/bf16; cand: [R, K] or [K] int; returns [R, K] float32."""
    x = logits.float()  # [R, V]
    if cand.dim() == 1:
        cand = cand.unsqueeze(0).expand(x.shape[0], -1)
    idx = cand.long()
    pad = idx < 0
    vals = x.gather(1, idx.clamp(min=0))  # [R, K]
    if not logits_mode:
        # Subtract the row max before anything else: x - (max + log s) would round at
        # ulp(max), ~1e-3 for logits near 1e4; (x - max) - log s stays exact to ~1e-7.
        mx = x.amax(dim=-1, keepdim=True)  # [R, 1]
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        lse = torch.logsumexp(x - mx, dim=-1, keepdim=True)  # [R, 1]
        vals = (vals - mx) - lse
    return vals.masked_fill(pad, float("-inf"))


def gather_logprobs_partial_reference(logits: torch.Tensor, cand: torch.Tensor, vocab_start: int,
                                      logits_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocab shard's share (``logits``: [R, Vr], ids [vocab_start, vocab_start + Vr)):
    (row max m [R], sum exp(x - m) s [R], candidates' logits [R, K]) in float32; candidates
    outside the shard and padding give 0 (they contribute nothing to a sum over shards). In
    logits mode m and s are not computed (zeros)."""
    x = logits.float()  # [R, Vr]
    if cand.dim() == 1:
        cand = cand.unsqueeze(0).expand(x.shape[0], -1)
    local = cand.long() - vocab_start
    inside = (cand >= 0) & (local >= 0) & (local < x.shape[1])
    vals = x.gather(1, local.clamp(0, x.shape[1] - 1)).masked_fill(~inside, 0.0)  # [R, K]
    if logits_mode:
        z = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        return z, z.clone(), vals
    m = x.amax(dim=-1)  # [R]
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m, torch.exp(x - safe[:, None]).sum(dim=-1), vals


def finish_partials(mx: torch.Tensor, sumexp: torch.Tensor, vals: torch.Tensor, cand: torch.Tensor,
                    logits_mode: bool = False) -> torch.Tensor:
    """[R, K] log-probs from the merged shard statistics: mx [R] the max over shards,
    sumexp [R] = sum_r exp(m_r - mx) s_r, vals [R, K] the candidates' logits summed over
    shards. log p = (logit - mx) - log sumexp; padding (cand < 0) gives -inf."""
    if cand.dim() == 1:
        cand = cand.unsqueeze(0).expand(vals.shape[0], -1)
    if not logits_mode:
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        vals = (vals - mx[:, None]) - torch.log(sumexp)[:, None]
    return vals.masked_fill(cand < 0, float("-inf"))


def merge_partials(ms: torch.Tensor, ss: torch.Tensor, vals: torch.Tensor, cand: torch.Tensor,
                   logits_mode: bool = False) -> torch.Tensor:
    """Combine N shards' partials held in one place (ms, ss [N, R]; vals [N, R, K]); the
    tensor-parallel scoring does the same with collectives (``engine.vocab_parallel``)."""
    mx = ms.amax(dim=0)  # [R]
    safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    return finish_partials(mx, (torch.exp(ms - safe) * ss).sum(dim=0), vals.sum(dim=0), cand, logits_mode)


def gather_logprobs_partial(logits: torch.Tensor, cand: torch.Tensor, vocab_start: int,
                            logits_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial mode of ``gather_logprobs`` for a vocab shard (vocab-parallel scoring):
    see ``gather_logprobs_partial_reference`` for the outputs. CUDA tensors go through the
    kernel (one pass over the shard, as the full mode), others through the reference."""
    _validate(logits, cand, None)
    rows, k = logits.shape[0], cand.shape[-1]
    if logits.is_cuda and rows > 0:
        ext = extension.load()
        if ext is not None and hasattr(ext, "gather_logprobs_partial_out"):
            dev = logits.device
            out = torch.empty((rows, k), dtype=torch.float32, device=dev)
            mx = torch.empty(rows, dtype=torch.float32, device=dev)
            se = torch.empty(rows, dtype=torch.float32, device=dev)
            if k > 1 and cand.stride(-1) != 1:
                cand = cand.contiguous()
            ext.gather_logprobs_partial_out(logits, cand, out, mx, se, vocab_start, logits_mode)
            return mx, se, out
    return gather_logprobs_partial_reference(logits, cand, vocab_start, logits_mode)


def mask_ids_(x: torch.Tensor, ids: torch.Tensor, vocab_start: int = 0) -> torch.Tensor:
    """Set ``x[r, ids[r, j] - vocab_start]`` to -inf in place (x: [R, Vr] float32, this shard's
    ids from ``vocab_start``; ids: [R, J] int64 global ids); negative ids (padding) and ids of
    other shards leave x alone. The log-sum-exp of what is left is the mass outside the ids.
    A scatter of min(x, +inf / -inf): padding and repeated ids may share a column, and the
    result does not depend on the order the scatter visits them."""
    local = ids - vocab_start
    inside = (ids >= 0) & (local >= 0) & (local < x.shape[1])  # [R, J]
    src = torch.where(inside, float("-inf"), float("inf")).to(x.dtype)
    return x.scatter_reduce_(1, local.clamp(0, x.shape[1] - 1), src, reduce="amin", include_self=True)


def gather_logprobs(
    logits: torch.Tensor,
    cand: torch.Tensor,
    logits_mode: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R, K] float32: ``log_softmax(logits[r])[cand[r, j]]`` (the logit itself when
    ``logits_mode``); ``cand < 0`` gives ``-inf``.

    logits: [R, V] float32/bfloat16/float16, last dim contiguous (any row stride).
    cand: [K] (shared by every row) or [R, K], int32/int64, on the logits' device; ids in
    [0, V) or negative (padding). Callers validate ids: an id >= V makes the reference
    raise and the kernel write NaN (it never reads out of bounds).
    out: optional [R, K] float32 contiguous tensor to write into (returned).
    """
    _validate(logits, cand, out)
    rows, k = logits.shape[0], cand.shape[-1]
    if logits.is_cuda and rows > 0 and k > 0:
        ext = extension.load()
        if ext is not None:
            if out is None:
                out = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
            if k > 1 and cand.stride(-1) != 1:
                cand = cand.contiguous()  # [.., K] ints: a cheap copy
            ext.gather_logprobs_out(logits, cand, out, logits_mode)
            return out
    res = gather_logprobs_reference(logits, cand, logits_mode)
    if out is None:
        return res
    return out.copy_(res)


def _validate(logits: torch.Tensor, cand: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise ValueError on anything the kernel (or the reference) cannot take."""
    if logits.dim() != 2:
        raise ValueError(f"gather_logprobs: logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"gather_logprobs: logits dtype must be float32, bfloat16 or float16, got {logits.dtype}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("gather_logprobs: logits have an empty vocab dimension")
    if vocab > 1 and logits.stride(1) != 1:
        raise ValueError(f"gather_logprobs: logits last dim must be contiguous (stride 1), "
                         f"got strides {logits.stride()}")
    if cand.dtype not in _CAND_DTYPES:
        raise ValueError(f"gather_logprobs: candidates must be int32 or int64, got {cand.dtype}")
    if cand.dim() not in (1, 2):
        raise ValueError(f"gather_logprobs: candidates must be [K] or [rows, K], got shape {tuple(cand.shape)}")
    if cand.dim() == 2 and cand.shape[0] != rows:
        raise ValueError(f"gather_logprobs: per-row candidates have {cand.shape[0]} rows, logits have {rows}")
    if cand.device != logits.device:
        raise ValueError(f"gather_logprobs: candidates on {cand.device}, logits on {logits.device}")
    if out is not None:
        k = cand.shape[-1]
        if out.shape != (rows, k) or out.dtype != torch.float32:
            raise ValueError(
                f"gather_logprobs: out must be [{rows}, {k}] float32, got {tuple(out.shape)} {out.dtype}"
            )
        if out.device != logits.device:
            raise ValueError(f"gather_logprobs: out on {out.device}, logits on {logits.device}")
        if not out.is_contiguous():
            raise ValueError(f"gather_logprobs: out must be contiguous, got strides {out.stride()}")


if __name__ == "__main__":
    extension.main(sys.argv[1:])
