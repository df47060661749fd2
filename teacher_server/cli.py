"""Command line: ``teacher-server serve [flags]`` (also ``python -m teacher_server serve``).

Flags map onto Config fields and win over the environment and the config file."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

import uvicorn

from teacher_server import __version__
from teacher_server.config import Config, ConfigError

log = logging.getLogger("teacher_server.server")


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
    s.add_argument("--attention-backend", choices=["auto", "sdpa", "varlen", "cudnn", "flash_attn"])
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
    from teacher_server.logging_setup import setup_logging
    from teacher_server.server.app import create_app

    setup_logging(cfg.log_level, cfg.log_json)
    app = create_app(cfg)
    server = DrainingServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None, access_log=False,
                                           timeout_graceful_shutdown=int(cfg.shutdown_timeout_s) + 5))
    server.drain_timeout = cfg.shutdown_timeout_s
    server.run()
    raise SystemExit(getattr(app.state, "exit_code", 0))


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: stop admitting (new requests get 503 and /health turns
    503, so load balancers move away) while in-flight requests finish, for at most
    ``drain_timeout`` seconds; then shut down as uvicorn does. A second signal exits now."""

    drain_timeout: float = 30.0
    _draining = False

    def handle_exit(self, sig: int, frame: object) -> None:
        ae = getattr(getattr(self.config.app, "state", None), "aengine", None)
        if self._draining or ae is None:
            return super().handle_exit(sig, frame)
        self._draining = True
        ae.stop_accepting()
        log.info("signal %s: draining %d in-flight request(s), at most %.0fs", sig, ae.in_flight, self.drain_timeout)

        def wait_then_exit() -> None:
            deadline = time.monotonic() + self.drain_timeout
            while ae.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            self.should_exit = True

        threading.Thread(target=wait_then_exit, daemon=True).start()


if __name__ == "__main__":
    main()
