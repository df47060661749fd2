"""The fast-accumulation error at model widths: relative RMS, max/|ref|max, and the regression slope
of got on ref (a scale error shows there), promoted and fast, row mode, plus with a 1% scale error."""
import json
import sys

import torch

from teacher_server.ops.fp8_mm import quantize_weight, scale_from_amax, scaled_linear, scaled_linear_reference, to_fp8

dev = torch.device("cuda")
out = []
for k, n in [(4096, 6144), (4096, 24576), (12288, 4096), (5120, 10240), (25600, 5120), (2048, 3072), (7168, 4096), (18432, 7168)]:
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        m = 33
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = torch.randn(n, k, generator=gen) * k ** -0.5
        wq, ws = quantize_weight(w, "row")
        xf = x.float()
        s = scale_from_amax(xf.abs().amax(-1, keepdim=True))
        xq, sx = to_fp8(xf, s).to(dev), s.to(dev)
        ref = scaled_linear_reference(xq.cpu(), sx.cpu(), wq, ws, "row", torch.float32, None)
        for fast in (False, True):
            for scl in (1.0, 1.01):
                got = scaled_linear(xq, sx * scl, wq.to(dev), ws.to(dev), "row", fast_accum=fast).float().cpu()
                err = got - ref
                rec = dict(k=k, n=n, seed=seed, fast=fast, scale=scl, rel=(err.norm() / ref.norm()).item(),
                           maxrel=(err.abs().max() / ref.abs().max()).item(),
                           slope=((got * ref).sum() / (ref * ref).sum()).item() - 1,
                           bias=(err.mean() / ref.abs().mean()).item())
                out.append(rec)
                print(rec, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
