"""FP8 accuracy on a W1 sample (docs/fp8.md, "Accuracy"): a random bf16 checkpoint of a model
shape, its block-wise FP8 twin (128 x 128 ``weight_scale_inv``, as Qwen's FP8 releases), and
the bf16 one served with ``--quantization fp8`` (per-row, at load). Reported, over the scored
rows of the first ``--requests`` W1 requests (their last ``--rows`` rows, K=64 candidates):

- ``vs_dequantized``: the FP8 scores (the engine's FP8 products) against a float32 forward of
  the same dequantized weights (the engine in float32, the weights dequantized at load): mean
  and max absolute error of the candidates' log-probs; the same for transformers' own
  fine-grained FP8 path on the block-wise checkpoint where it runs (a GPU, accelerate);
- ``kl_bf16_fp8``: the mean full-vocabulary KL(bf16 || FP8) per scored row, the bf16 model's
  scores against each FP8 one's: what switching costs.

GPU: ``python bench/fp8_accuracy.py --shape qwen3-8b --out out/fp8_accuracy_8b.json``.
CPU: ``python bench/fp8_accuracy.py --tiny`` (the same path at a small size; FP8 products by
ops.fp8's definitions: ``--emulate``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_fp8_kernel
from workloads import QWEN3_8B, QWEN3_32B, make_workload, tiny, write_config, write_random_checkpoint

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest
from teacher_server.layers.formats import fp8 as fp8_format

SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3-32b": QWEN3_32B}
PROJECTION = re.compile(r"_proj\.weight$")  # what the FP8 releases quantize (not the embedding or LM head)
BLOCK = 128


def quantize_block(w: torch.Tensor, b: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scales [ceil(N / b), ceil(K / b)] float32): one scale per
    b x b block, its largest magnitude / 448."""
    n, k = w.shape
    nb, kb = -(-n // b), -(-k // b)
    padded = torch.zeros(nb * b, kb * b, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, b, kb, b)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(nb * b, kb * b)[:n, :k].contiguous(), scale


def write_block_fp8(src: Path, dst: Path) -> Path:
    """The block-wise FP8 twin of checkpoint ``src`` (kept when there)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (dst / "model.safetensors.index.json").exists():
        return dst
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    write_config(dst, cfg)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for fname in sorted(set(index["weight_map"].values())):
        out = {}
        with safe_open(str(src / fname), framework="pt", device=dev) as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if PROJECTION.search(name):
                    q, s = quantize_block(t)
                    out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q.cpu(), s.cpu()
                else:
                    out[name] = t.cpu()
        save_file(out, str(dst / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, fname)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def full_vocab_scores(path: Path, reqs: list, vocab: int, dtype: str, quantization: str | None,
                      fp8_products: bool, device: str) -> list[np.ndarray]:
    """Each request's [rows, vocab] log-probs from the engine (a flat candidate list of every
    id), with FP8 products on or off (off: the weights dequantized at load)."""
    fp8_format.fp8_compute = (lambda d: True) if fp8_products else (lambda d: False)
    cfg = Config(model=str(path), device=device, dtype=dtype, quantization=quantization, max_logprobs=-1,
                 max_rows_x_k=2**31 - 1, warm_up=False, compile=False,  # (five engines: no compile waits)
                 max_model_len=max(len(r.tokens) for r in reqs) + 16,
                 **({"num_kv_blocks": 512} if device == "cpu" else {}))
    eng = Engine(cfg)
    try:
        every = np.arange(vocab)
        out = eng.run_to_completion([ScoreRequest(f"r{i}", r.tokens, r.start, every.astype(np.int32))
                                     for i, r in enumerate(reqs)])
        assert all(o.error is None for o in out), [o.error for o in out]
        return [o.token_id_logprobs for o in out]
    finally:
        eng.close()
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def transformers_fp8_scores(path: Path, reqs: list, kernel: str | None = None) -> tuple[list[np.ndarray], dict]:
    """transformers' fine-grained FP8 forward of the block-wise checkpoint (GPU): each request's
    [rows, vocab] float32 log-probs, and the kernel it ran (``kernel``: its source folder, where
    the hub cannot be reached; ``hf_fp8_kernel``)."""
    import transformers as tf

    info = hf_fp8_kernel.install(kernel) if kernel else {"path": "the kernels package's download"}

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()
    out = []
    with torch.no_grad():
        for r in reqs:
            ids = torch.tensor([r.tokens.tolist()], device="cuda")
            logits = model(ids, logits_to_keep=r.rows + 1).logits[0, :r.rows]  # rows start .. L-2
            out.append(torch.log_softmax(logits.float(), -1).cpu().numpy())
    info["fp8_linear_layers"] = sum(type(m).__name__ == "FP8Linear" for m in model.modules())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out, info


def errors(got: list[np.ndarray], ref: list[np.ndarray], reqs: list) -> dict[str, float]:
    """Mean and max absolute error of the candidates' log-probs (the workload's K per row)."""
    diffs = [np.abs(np.take_along_axis(g, r.cand.astype(np.int64), 1) - np.take_along_axis(f, r.cand.astype(np.int64),
                                                                                              1)).ravel()
             for g, f, r in zip(got, ref, reqs)]
    d = np.concatenate(diffs)
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max())}


def mean_kl(p_log: list[np.ndarray], q_log: list[np.ndarray]) -> float:
    """Mean over rows of KL(p || q) = sum_v p (log p - log q), in float64."""
    kls = [(np.exp(p.astype(np.float64)) * (p.astype(np.float64) - q.astype(np.float64))).sum(-1)
           for p, q in zip(p_log, q_log)]
    return float(np.concatenate(kls).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    ap.add_argument("--tiny", action="store_true", help="a small model of the shape's family (CPU runs)")
    ap.add_argument("--requests", type=int, default=8, help="the first N requests of W1")
    ap.add_argument("--rows", type=int, default=256, help="scored rows per request (its last ones)")
    ap.add_argument("--dir", default="/tmp/ts-fp8-accuracy", help="where the checkpoints are written")
    ap.add_argument("--emulate", action="store_true",
                    help="FP8 products by ops.fp8's definitions where the device has none (the CPU default)")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' FP8 path")
    ap.add_argument("--only", default="", help="of bf16,block,online: these runs alone (each error's float32 "
                    "reference runs with it; transformers' path beside block)")
    ap.add_argument("--hf-fp8-kernel", default=os.environ.get("HF_FP8_KERNEL"),
                    help="transformers' finegrained-fp8 kernel from this folder (no network; hf_fp8_kernel.py)")
    ap.add_argument("--out", help="JSON results file")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    emulate = args.emulate or not cuda
    cfg = tiny(SHAPES[args.shape]) if args.tiny else SHAPES[args.shape]
    root = Path(args.dir) / (args.shape + ("-tiny" if args.tiny else ""))
    t0 = time.perf_counter()
    bf16 = write_random_checkpoint(root / "bf16", cfg)
    block = write_block_fp8(bf16, root / "fp8_block")
    vocab = cfg["vocab_size"]
    reqs = []
    for r in make_workload("W1:tiny" if args.tiny else "W1", vocab)[:args.requests]:
        rows = min(args.rows, r.rows)
        reqs.append(type(r)(r.tokens, len(r.tokens) - 1 - rows, r.cand[-rows:]))
    model_dtype = "bfloat16" if cuda else "float32"
    print(f"checkpoints ready in {time.perf_counter() - t0:.0f}s; {len(reqs)} requests, "
          f"{sum(r.rows for r in reqs)} scored rows", flush=True)
    fp8_products = cuda or emulate
    runs = {
        "bf16": (bf16, model_dtype, None, False),
        "block": (block, model_dtype, None, fp8_products),
        "block_ref": (block, "float32", None, False),
        "online": (bf16, model_dtype, "fp8", fp8_products),
        "online_ref": (bf16, "float32", "fp8", False),
    }
    keep = set(args.only.split(",")) if args.only else set(runs)
    keep |= {f"{v}_ref" for v in ("block", "online") if v in keep}  # an error needs its reference
    scores = {}
    for name, (path, dtype, quant, products) in runs.items():
        if name not in keep:
            continue
        t = time.perf_counter()
        scores[name] = full_vocab_scores(path, reqs, vocab, dtype, quant, products, device)
        print(f"{name}: {time.perf_counter() - t:.0f}s", flush=True)
    result = {
        "shape": args.shape, "tiny": args.tiny, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "fp8_products": "emulated (ops.fp8 definitions)" if emulate and not cuda else "device",
        "requests": len(reqs), "rows": sum(r.rows for r in reqs), "k": int(reqs[0].cand.shape[1]),
        "vs_dequantized": {v: errors(scores[v], scores[f"{v}_ref"], reqs) for v in ("block", "online") if v in scores},
        "kl_bf16_fp8": {v: mean_kl(scores["bf16"], scores[v]) for v in ("block", "online")
                        if v in scores and "bf16" in scores},
    }
    if cuda and not args.no_transformers and "block_ref" in scores:
        try:
            theirs, result["transformers_kernel"] = transformers_fp8_scores(block, reqs, args.hf_fp8_kernel)
            result["vs_dequantized"]["transformers_block"] = errors(theirs, scores["block_ref"], reqs)
        except Exception as e:  # reported: no accelerate, a transformers without that path, ...
            result["vs_dequantized"]["transformers_block"] = f"not run: {type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
