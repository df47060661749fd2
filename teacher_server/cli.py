"""Command line: ``teacher-server serve [flags]`` (also ``python -m teacher_server serve``).

Every Config field has a flag, generated from the field (its description is the help text):
``--max-logprobs 64``, ``--no-enable-prefix-caching``, ``--max-model-len none``. Flags win over
the environment and the config file."""

from __future__ import annotations

import argparse
import sys
import typing

from pydantic.fields import FieldInfo

from teacher_server import __version__
from teacher_server.config import NONE_WORDS, Config, ConfigError


def build_parser() -> argparse.ArgumentParser:
    """`teacher-server serve` with one flag per Config field (plus `--config FILE`)."""
    p = argparse.ArgumentParser(prog="teacher-server", description=__doc__)
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the HTTP scoring service")
    s.add_argument("--config", help="YAML config file (see config.yaml)")
    for name, field in Config.model_fields.items():
        add_field_flag(s, name, field)
    # its flags are its own parser's (teacher_server/benchmark/command.py); main() hands it the arguments
    sub.add_parser("bench", add_help=False, help="benchmark the canonical workloads against a running server (--url), "
                                                 "a checkpoint (--model) or a model shape: `teacher-server bench -h`")
    return p


def add_field_flag(parser: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    """``--name-with-dashes`` for one Config field, its help text and default taken from the
    field. Absent flags leave the namespace untouched (``SUPPRESS``), so a flag given as
    ``none`` can still set an optional field to None."""
    kind, choices, optional = _field_kind(field.annotation)
    help_text = f"{field.description or name.replace('_', ' ')} (default: {field.default})".replace("%", "%%")
    flag = "--" + name.replace("_", "-")
    if kind is bool:
        parser.add_argument(flag, dest=name, action=_OptionalBool if optional else argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=help_text)
        return
    convert = _converter(kind, optional)
    parser.add_argument(flag, dest=name, type=convert, default=argparse.SUPPRESS, help=help_text,
                        choices=[*choices, *([None] if optional else [])] if choices else None,
                        metavar="{" + ",".join(choices) + "}" if choices else kind.__name__.upper())


class _OptionalBool(argparse.Action):
    """A setting that is true, false or none (decided by the server): ``--x`` / ``--no-x`` as
    for other booleans, and ``--x none`` (or ``--x true`` / ``--x false``)."""

    WORDS = {**dict.fromkeys(NONE_WORDS), "true": True, "false": False}

    def __init__(self, option_strings: list[str], dest: str, **kw: object) -> None:
        names = [*option_strings, *("--no-" + o[2:] for o in option_strings if o.startswith("--"))]
        super().__init__(names, dest, nargs="?", metavar="{none,true,false}", **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value")
            setattr(namespace, self.dest, False)
            return
        if values is None:
            setattr(namespace, self.dest, True)
            return
        word = str(values).lower()
        if word not in self.WORDS:
            parser.error(f"{option_string}: expected none, true or false, not {values!r}")
        setattr(namespace, self.dest, self.WORDS[word])


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
        if optional and text.lower() in NONE_WORDS:
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from teacher_server.benchmark.command import main as bench_main

        return bench_main(argv[1:])
    try:
        cfg = config_from_args(argv)
    except ConfigError as e:
        print(f"teacher-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from teacher_server.logging_setup import setup_logging
    from teacher_server.server.app import create_app
    from teacher_server.server.http import uvicorn_config
    from teacher_server.server.lifecycle import DrainingServer

    setup_logging(cfg.log_level, cfg.log_json)
    app = create_app(cfg)
    # The drain itself is bounded by shutdown_timeout_s (DrainingServer); uvicorn's own
    # graceful wait then only covers writing the last responses.
    server = DrainingServer(uvicorn_config(app, cfg, timeout_graceful_shutdown=3), app, cfg.shutdown_timeout_s)
    server.run()
    raise SystemExit(getattr(app.state, "exit_code", 0))


if __name__ == "__main__":
    main()
