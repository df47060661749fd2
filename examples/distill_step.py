"""One on-policy distillation step against a running teacher-server.

The student has sampled responses and recorded its top-K candidate ids (and their
log-probs) at every response position. The teacher scores exactly those candidates;
the loss is a forward KL over the K candidates at each response token:

    p_t = softmax over K of the teacher log-probs   (teacher renormalised over the candidates)
    q_s = softmax over K of the student log-probs
    loss[token] = sum_j p_t[j] * (log p_t[j] - log q_s[j])

Its gradient with respect to the student's K logits is ``q_s - p_t``, which is what a
trainer would back-propagate. Without ``--rollouts`` the batch is random, for the demo
model's vocabulary of 4096 (GRPO-shaped: ``--group`` responses per prompt, so the server's
prefix cache computes each prompt once).

    python examples/distill_step.py [--url http://127.0.0.1:8000] [--rollouts FILE.jsonl]

A rollouts file has one JSON object a line: ``prompt_ids``, ``response_ids``,
``student_topk_ids`` ([len(response), K], -1 pads) and ``student_topk_logprobs`` (same shape).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from teacher_server.client import TeacherClient, TeacherRequest


@dataclass
class Rollout:
    """One student response and the student's top-K at each of its positions."""

    prompt_ids: list[int]
    response_ids: list[int]
    student_topk_ids: np.ndarray  # [T, K] int32, -1 pads
    student_topk_logprobs: np.ndarray  # [T, K] float32 student log-probs of those ids


def random_rollouts(prompts: int, group: int, prompt_len: int, response_len: int, k: int, vocab: int,
                    seed: int = 0) -> list[Rollout]:
    """``prompts`` x ``group`` random rollouts; the sampled token is always the first candidate."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        for _ in range(group):
            response = rng.integers(0, vocab, response_len)
            ids = np.empty((response_len, k), dtype=np.int32)
            for t, tok in enumerate(response):
                others = rng.choice(vocab - 1, k - 1, replace=False)
                ids[t, 0], ids[t, 1:] = tok, others + (others >= tok)  # k distinct ids, the sampled one first
            logits = -np.sort(-rng.normal(0.0, 2.0, (response_len, k)), axis=1)
            mass = rng.uniform(0.6, 0.99, (response_len, 1))  # the top-K hold most, not all, of the student's mass
            lp = logits - _logsumexp(logits) + np.log(mass)
            out.append(Rollout(prompt, response.tolist(), ids, lp.astype(np.float32)))
    return out


def load_rollouts(path: Path) -> list[Rollout]:
    """Rollouts from a JSON-lines file (see the module docstring)."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Rollout(d["prompt_ids"], d["response_ids"], np.asarray(d["student_topk_ids"], np.int32),
                               np.asarray(d["student_topk_logprobs"], np.float32)))
    return out


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """Row-wise logsumexp over the last axis, keepdims; rows of all -inf give -inf."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True)) + m


def distill_loss(teacher_lp: np.ndarray, student_lp: np.ndarray, cand_ids: np.ndarray) -> np.ndarray:
    """Per-token forward KL(p_t || q_s) over the valid candidates; [T, K] inputs -> [T] float64."""
    valid = cand_ids >= 0  # padding scores -inf on the teacher side
    t = np.where(valid, teacher_lp.astype(np.float64), -np.inf)
    s = np.where(valid, student_lp.astype(np.float64), -np.inf)
    log_pt = np.where(valid, t - _logsumexp(t), 0.0)  # padded entries: p_t = 0, no term
    log_qs = np.where(valid, s - _logsumexp(s), 0.0)
    pt = np.where(valid, np.exp(log_pt), 0.0)
    return np.sum(pt * (log_pt - log_qs), axis=-1)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Score a batch of rollouts, compute the loss, print a summary; returns the numbers printed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="teacher-server base URL")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--rollouts", type=Path, default=None, help="JSON-lines rollouts (default: random)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("-k", type=int, default=16, help="student candidates per position")
    ap.add_argument("--vocab", type=int, default=4096, help="the teacher's vocabulary (4096 for the demo model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args(argv)

    rollouts = (load_rollouts(args.rollouts) if args.rollouts else
                random_rollouts(args.prompts, args.group, args.prompt_len, args.response_len, args.k,
                                args.vocab, args.seed))
    # Row i of the result scores token start + i + 1, so start = len(prompt) - 1 makes
    # the rows line up with the response tokens. One salt per step keeps the prompt cache
    # shared within the step's groups only.
    salt = f"step-{uuid.uuid4().hex[:8]}"
    requests = [TeacherRequest(r.prompt_ids + r.response_ids, r.student_topk_ids, len(r.prompt_ids) - 1,
                               cache_salt=salt) for r in rollouts]
    t0 = time.perf_counter()
    with TeacherClient(args.url, api_key=args.api_key, max_concurrency=args.concurrency) as client:
        outs = client.score_batch_full(requests)
    elapsed = time.perf_counter() - t0

    per_token = np.concatenate([distill_loss(o.scores, r.student_topk_logprobs, r.student_topk_ids)
                                for o, r in zip(outs, rollouts)])
    # How much of the teacher's probability the student's candidates cover.
    coverage = np.concatenate([np.exp(_logsumexp(o.scores)[:, 0]) for o in outs])
    summary = {
        "rollouts": len(rollouts),
        "scored_tokens": int(per_token.size),
        "seconds": elapsed,
        "tokens_per_s": sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts) / elapsed,
        "cached_tokens": sum(o.cached_tokens for o in outs),
        "loss": float(per_token.mean()),
        "loss_max": float(per_token.max()),
        "teacher_mass_on_topk": float(coverage.mean()),
    }
    print(f"scored {summary['rollouts']} rollouts ({summary['scored_tokens']} response tokens, "
          f"K={rollouts[0].student_topk_ids.shape[1]}) in {elapsed:.2f}s "
          f"({summary['tokens_per_s']:.0f} tok/s, {summary['cached_tokens']} prompt tokens from the prefix cache)")
    print(f"forward KL over the student's top-K: mean {summary['loss']:.4f} nats/token, "
          f"max {summary['loss_max']:.4f}; teacher mass on those candidates {summary['teacher_mass_on_topk']:.4f}")
    return summary


if __name__ == "__main__":
    main()
