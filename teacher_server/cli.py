"""Command line: ``teacher-server serve [flags]`` (also ``python -m teacher_server serve``).

Every Config field has a flag, generated from the field (its description is the help text):
``--max-logprobs 64``, ``--no-enable-prefix-caching``, ``--max-model-len none``. Flags win over
the environment and the config file."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import typing

import uvicorn
from pydantic.fields import FieldInfo

from teacher_server import __version__
from teacher_server.config import Config, ConfigError

log = logging.getLogger("teacher_server.server")


def build_parser() -> argparse.ArgumentParser:
    """`teacher-server serve` with one flag per Config field (plus `--config FILE`)."""
    p = argparse.ArgumentParser(prog="teacher-server", description=__doc__)
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the HTTP scoring service")
    s.add_argument("--config", help="YAML config file (see config.yaml)")
    for name, field in Config.model_fields.items():
        add_field_flag(s, name, field)
    return p


def add_field_flag(parser: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    """``--name-with-dashes`` for one Config field, its help text and default taken from the
    field. Absent flags leave the namespace untouched (``SUPPRESS``), so a flag given as
    ``none`` can still set an optional field to None."""
    kind, choices, optional = _field_kind(field.annotation)
    help_text = f"{field.description or name.replace('_', ' ')} (default: {field.default})".replace("%", "%%")
    flag = "--" + name.replace("_", "-")
    if kind is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                            help=help_text)
        return
    convert = _converter(kind, optional)
    parser.add_argument(flag, dest=name, type=convert, default=argparse.SUPPRESS, help=help_text,
                        choices=[*choices, *([None] if optional else [])] if choices else None,
                        metavar="{" + ",".join(choices) + "}" if choices else kind.__name__.upper())


def _field_kind(annotation: object) -> tuple[type, list[str], bool]:
    """(scalar type, Literal choices, whether None is allowed) of a Config field's annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = type(None) in typing.get_args(annotation)
    target = args[0] if optional and len(args) == 1 else annotation
    if typing.get_origin(target) is typing.Literal:
        return str, [str(c) for c in typing.get_args(target)], optional
    assert target in (bool, int, float, str), f"no command-line form for {annotation!r}"
    return target, [], optional  # type: ignore[return-value]


def _converter(kind: type, optional: bool):  # noqa: ANN202
    def convert(text: str):  # noqa: ANN202
        if optional and text.lower() in ("none", "null"):
            return None
        return kind(text)
    convert.__name__ = kind.__name__  # argparse names the type in its error messages
    return convert


def config_from_args(argv: list[str] | None = None) -> Config:
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    file = args.pop("config")
    cfg = Config.load(file, overrides=args)  # only the flags given are in args
    for name in [k for k, v in args.items() if v is None]:  # `--flag none` resets what the file or env set
        setattr(cfg, name, None)  # validated (validate_assignment)
    return cfg


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
