"""Command line: ``teacher-server serve [flags]`` (also ``python -m teacher_server serve``).

Flags map onto Config fields and win over the environment and the config file."""

from __future__ import annotations

import argparse
import sys

from teacher_server import __version__
from teacher_server.config import Config, ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="teacher-server", description=__doc__)
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the HTTP scoring service")
    s.add_argument("--config", help="YAML config file (see config.yaml)")
    s.add_argument("--model", help="HF checkpoint directory; omitted: the built-in demo model")
    s.add_argument("--served-model-name")
    s.add_argument("--load-format", choices=["auto", "safetensors", "dummy"])
    s.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    s.add_argument("--device", choices=["auto", "cpu", "cuda"])
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--api-key", help="require Authorization: Bearer KEY (or TEACHER_SERVER_API_KEY)")
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--max-logprobs", type=int)
    s.add_argument("--logprobs-mode", choices=["raw_logprobs", "raw_logits"])
    s.add_argument("--max-num-batched-tokens", type=int)
    s.add_argument("--max-num-seqs", type=int)
    s.add_argument("--num-kv-blocks", type=int)
    s.add_argument("--block-size", type=int)
    s.add_argument("--gpu-memory-utilization", type=float)
    s.add_argument("--attention-backend", choices=["auto", "sdpa", "varlen", "flash_attn"])
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    s.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None)
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=None)
    return p


def config_from_args(argv: list[str] | None = None) -> Config:
    args = vars(_parser().parse_args(argv))
    args.pop("command")
    file = args.pop("config")
    return Config.load(file, overrides=args)


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = config_from_args(argv)
    except ConfigError as e:
        print(f"teacher-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    import uvicorn

    from teacher_server.logging_setup import setup_logging
    from teacher_server.server.app import create_app

    setup_logging(cfg.log_level, cfg.log_json)
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_config=None, access_log=False,
                timeout_graceful_shutdown=int(cfg.shutdown_timeout_s) + 5)


if __name__ == "__main__":
    main()
