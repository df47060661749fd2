"""vLLM's ``vllm serve`` flags that launch scripts pass, on ``teacher-server serve``.

Aliases of our flags (``-tp``, ``-dp``), flags mapped onto a setting of ours
(``--enforce-eager``: no torch.compile; ``--num-gpu-blocks-override``: ``num_kv_blocks``;
``--enable-expert-parallel``: ``moe_parallel`` expert; ``--hf-token``: the hub token of this
process), and flags accepted with no effect because what they switch does not exist here
(``--trust-remote-code``: no checkpoint code is ever run; request and stats logging). Settings
of our own that carry vLLM's name (``--served-model-name``, ``--dtype``, ``--kv-cache-dtype``,
``--ssl-keyfile``, ``--root-path``, ...) are Config fields. docs/cli.md has the table."""

from __future__ import annotations

import argparse
import os

from teacher_server.human_int import human_int

# the parsed values of the flags below (a prefix no Config field has)
PREFIX = "vllmflag_"

# short forms of our own flags, by Config field
ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "data_parallel_size": ["-dp"],
           "quantization": ["-q"]}

# accepted and ignored: flag -> why it means nothing here (logged once at start-up)
NO_EFFECT = {
    "trust_remote_code": "the model families are implemented here; a checkpoint's Python code is never run",
    "enable_log_requests": "every request has its access line at log level info already",
    "disable_log_requests": "every request has its access line at log level info (log_level warning hides it)",
    "disable_log_stats": "no periodic stats lines are logged; /metrics has them",
}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags that are not Config fields (their values land under ``vllmflag_*`` names)."""
    g = parser.add_argument_group("vLLM compatibility (see docs/cli.md)")
    g.add_argument("--trust-remote-code", dest="vllmflag_trust_remote_code", action="store_true",
                   default=argparse.SUPPRESS, help=f"accepted, no effect: {NO_EFFECT['trust_remote_code']}")
    for name in ("enable_log_requests", "disable_log_requests", "disable_log_stats"):
        g.add_argument("--" + name.replace("_", "-"), dest="vllmflag_" + name, action=argparse.BooleanOptionalAction,
                       default=argparse.SUPPRESS, help=f"accepted, no effect: {NO_EFFECT[name]}")
    g.add_argument("--hf-token", dest="vllmflag_hf_token", nargs="?", const=True, default=argparse.SUPPRESS,
                   metavar="TOKEN", help="Hugging Face token for gated or private hub models (sets HF_TOKEN for "
                                         "this process); without a value: the token of `hf auth login`")
    g.add_argument("--enforce-eager", dest="vllmflag_enforce_eager", action="store_true", default=argparse.SUPPRESS,
                   help="no torch.compile (as --no-compile); our CUDA kernels still run")
    g.add_argument("--num-gpu-blocks-override", dest="vllmflag_num_gpu_blocks_override", type=human_int,
                   default=argparse.SUPPRESS, metavar="INT", help="as --num-kv-blocks")
    g.add_argument("--enable-expert-parallel", "-ep", dest="vllmflag_enable_expert_parallel", action="store_true",
                   default=argparse.SUPPRESS, help="as --moe-parallel expert (whole experts per tensor-parallel rank)")


def apply_vllm_flags(args: dict[str, object]) -> list[str]:
    """Take the ``vllmflag_*`` entries out of parsed ``args`` and map them onto settings (in place);
    returns the notes to log once logging is set up."""
    notes: list[str] = []
    for key in [k for k in args if k.startswith(PREFIX)]:
        name, value = key[len(PREFIX):], args.pop(key)
        if name in NO_EFFECT:
            notes.append(f"--{name.replace('_', '-')} has no effect here: {NO_EFFECT[name]}")
        elif name == "hf_token":
            if isinstance(value, str):  # else huggingface_hub finds the saved login itself
                os.environ["HF_TOKEN"] = value
        elif name == "enforce_eager" and value:
            args.setdefault("compile", False)  # an explicit --compile wins
        elif name == "num_gpu_blocks_override":
            args.setdefault("num_kv_blocks", value)
        elif name == "enable_expert_parallel" and value:
            args.setdefault("moe_parallel", "expert")  # an explicit --moe-parallel wins
    return notes
