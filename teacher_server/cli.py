"""Command line: ``teacher-server serve [flags]`` (also ``python -m teacher_server serve``).

Every Config field has a flag, generated from the field (its description is the help text):
``--max-logprobs 64``, ``--no-enable-prefix-caching``, ``--max-model-len none``. Flags win over
the environment and the config file. vLLM's form works too: ``teacher-server serve MODEL -tp 2
--max-model-len 32k`` (teacher_server.vllm_flags; docs/cli.md lists every flag)."""

from __future__ import annotations

import argparse
import logging
import re
import sys
import typing

from pydantic.fields import FieldInfo

from teacher_server import __version__
from teacher_server.config import DTYPE_ALIASES, NONE_WORDS, Config, ConfigError
from teacher_server.did_you_mean import did_you_mean
from teacher_server.human_int import human_int
from teacher_server.vllm_flags import ALIASES, add_vllm_flags, apply_vllm_flags

# settings whose flag takes several values (vLLM's --served-model-name a b)
SEVERAL = {"served_model_name"}
# choice settings whose refusal Config words (dtype: the right spelling, and vLLM's half and
# float; kv_cache_dtype: what is built)
OWN_MESSAGES = {"dtype", "kv_cache_dtype"}


class OneLineErrors(argparse.ArgumentParser):
    """A usage mistake is one line naming the flag (the serve usage would be ~40 lines), with the
    closest flag for a misspelt one. Flags are never matched by a prefix (``--max-logprob`` is not
    ``--max-logprobs``: a misspelling is refused, not guessed)."""

    flag_names: list[str] = []  # the flags the misspelt one is compared with (build_parser sets them)

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        unknown = re.search(r"unrecognized arguments: (--[\w-]+)", message)
        hint = did_you_mean(unknown.group(1), self.flag_names) if unknown else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {getattr(self, 'help_for', self.prog)} --help)\n")

    def parse_args(self, args: typing.Any = None, namespace: typing.Any = None) -> typing.Any:
        ns, extra = self.parse_known_args(args, namespace)
        if extra:  # (the command's flags are in its own help, not the top level's)
            command = getattr(ns, "command", None)
            self.help_for = f"{self.prog} {command}" if command else self.prog
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns

    def parse_known_args(self, args: typing.Any = None, namespace: typing.Any = None) -> typing.Any:
        # `teacher-server --dtype bf16`: argparse would call 'bf16' an invalid command
        first = next(iter(args or []), "")
        if self.flag_names and first.startswith("-") and first.split("=")[0] not in ("-h", "--help", "--version"):
            self.error(f"{first.split('=')[0]}: flags follow the command, as in `{self.prog} serve {first} ...`")
        return super().parse_known_args(args, namespace)


class _Choices(list):
    """A flag's choices, None (``--flag none``) shown as 'none' in argparse's "choose from" list."""

    def __iter__(self) -> typing.Iterator[typing.Any]:
        return ("none" if c is None else c for c in super().__iter__())


def build_parser() -> argparse.ArgumentParser:
    """`teacher-server serve [MODEL]` (and `worker`, a worker node's) with one flag per Config
    field (plus `--config FILE`) and vLLM's flags (teacher_server.vllm_flags)."""
    p = OneLineErrors(prog="teacher-server", description=__doc__)
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineErrors)
    for command, text in (("serve", "run the HTTP scoring service"),
                          ("worker", "run this host's ranks of a model spread over nnodes hosts (node_rank >= 1; "
                                     "node 0 runs serve): the same settings as serve")):
        s = sub.add_parser(command, help=text)
        s.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                       help="the model, as --model (vLLM's `vllm serve MODEL` form)")
        s.add_argument("--version", action="version", version=__version__)
        s.add_argument("--config", help="YAML config file (see config.yaml)")
        for name, field in Config.model_fields.items():
            add_field_flag(s, name, field)
        add_vllm_flags(s)
    p.flag_names = sorted({o for a in s._actions for o in a.option_strings if o.startswith("--")})
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
    flags = ["--" + name.replace("_", "-"), *ALIASES.get(name, [])]
    if kind is bool:
        parser.add_argument(*flags, dest=name, action=_OptionalBool if optional else argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=help_text)
        return
    if kind is list:  # several values, or vLLM's one JSON list ('["*"]'); Config takes either
        # teachers: one per `--teacher SPEC`, each flag adding to the list (the others: the last flag holds)
        several = name == "teachers"
        parser.add_argument(*flags, *(["--teacher"] if several else []), dest=name, nargs="+",
                            action="extend" if several else "store", default=argparse.SUPPRESS, help=help_text,
                            metavar="STR")
        return
    metavar = "{" + ",".join([*choices, *(DTYPE_ALIASES if name == "dtype" else [])]) + "}" if choices \
        else kind.__name__.upper()
    if name in OWN_MESSAGES:  # Config's message is clearer than argparse's list of choices
        choices = []
    convert = _converter(kind, optional, name)
    parser.add_argument(*flags, dest=name, type=convert, default=argparse.SUPPRESS, help=help_text,
                        nargs="+" if name in SEVERAL else None, metavar=metavar,
                        choices=_Choices([*choices, *([None] if optional else [])]) if choices else None)


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
    if typing.get_origin(target) is list:
        return list, [], optional
    assert target in (bool, int, float, str), f"no command-line form for {annotation!r}"
    return target, [], optional  # type: ignore[return-value]


def _converter(kind: type, optional: bool, name: str = ""):  # noqa: ANN202
    def convert(text: str):  # noqa: ANN202
        if optional and text.lower() in NONE_WORDS:
            return None
        if kind is not int:
            return kind(text)
        if name == "max_model_len" and text.strip().lower() in ("auto", "-1"):
            raise argparse.ArgumentTypeError(f"{text!r} (vLLM's length fitted to memory) is not taken here: give a "
                                             "length (e.g. 32k), or leave the flag out for the model's own")
        try:
            return human_int(text)  # 32k, as vLLM's flags
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = kind.__name__  # argparse names the type in its error messages
    return convert


def config_from_args(argv: list[str] | None = None, notes: list[str] | None = None) -> Config:
    """The configuration that ``argv`` (``serve ...``) makes; ``notes`` receives what is worth
    a log line once logging is up (vLLM flags with no effect here)."""
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    file = args.pop("config")
    positional = args.pop("model_tag")
    if positional is not None:
        if args.get("model") not in (None, positional):
            raise ConfigError(f"the model is given twice: {positional!r} and --model {args['model']!r}")
        args["model"] = positional
    if args.get("served_model_name") == [None]:  # --served-model-name none
        args["served_model_name"] = None
    (notes if notes is not None else []).extend(apply_vllm_flags(args))
    cfg = Config.load(file, overrides=args)  # only the flags given are in args
    for name in [k for k, v in args.items() if v is None]:  # `--flag none` resets what the file or env set
        setattr(cfg, name, None)  # validated (validate_assignment)
    return cfg


def main(argv: list[str] | None = None) -> None:
    notes: list[str] = []
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from teacher_server.benchmark.command import main as bench_main

        return bench_main(argv[1:])
    try:
        cfg = config_from_args(argv, notes)
        if (argv[:1] == ["worker"]) != (cfg.node_rank > 0):
            raise ConfigError(f"node_rank={cfg.node_rank}: node 0 (the leader) runs `teacher-server serve`, nodes "
                              f"1..nnodes-1 run `teacher-server worker`")
        if cfg.nnodes > 1:  # the key, before anything starts (the leader's engine would ask only after the port opened)
            from teacher_server.engine.remote_ranks import node_authkey

            try:
                node_authkey(cfg)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    except ConfigError as e:
        print(f"teacher-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if argv[:1] == ["worker"]:
        return run_worker(cfg, notes)
    from teacher_server.replicas.preload import may_need_engine_process, start_preloading

    # the engine's process imports while this one imports the app (several teachers: each in processes of its own)
    if cfg.teachers or may_need_engine_process(cfg):
        start_preloading()
    from teacher_server.logging_setup import setup_logging
    from teacher_server.server.app import create_app
    from teacher_server.server.http import check_port_free, uvicorn_config
    from teacher_server.server.lifecycle import DrainingServer

    setup_logging(cfg.log_level, cfg.log_json)
    for note in notes:
        logging.getLogger("teacher_server").info("%s", note)
    try:
        # before the engine loads (uvicorn binds after the app's start-up has begun it); a
        # missing GPU is one line here, whichever process the engine would have run in
        from teacher_server.engine.rank_setup import check_gpus

        try:
            for t in cfg.teacher_configs():  # (several teachers: each on its own GPUs, named in its gpus)
                check_gpus(t.device, t.tensor_parallel_size, t.data_parallel_size, t.pipeline_parallel_size,
                           t.nnodes)
        except RuntimeError as e:
            raise ConfigError(str(e)) from None
        check_port_free(cfg.host, cfg.port)
        if cfg.nnodes > 1:  # the worker nodes' control listener, on every address (as it binds)
            if cfg.master_port == cfg.port:
                raise ConfigError(f"master_port {cfg.master_port} is the HTTP port too: give the worker nodes' "
                                  "control listener a port of its own (--master-port N)")
            check_port_free("0.0.0.0", cfg.master_port, "master_port")
        app = create_app(cfg)
        # The drain itself is bounded by shutdown_timeout_s (DrainingServer); uvicorn's own
        # graceful wait then only covers writing the last responses.
        server = DrainingServer(uvicorn_config(app, cfg, timeout_graceful_shutdown=3), app, cfg.shutdown_timeout_s)
    except ConfigError as e:
        print(f"teacher-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    server.run()
    raise SystemExit(getattr(app.state, "exit_code", 0))


def run_worker(cfg: Config, notes: list[str]) -> typing.NoReturn:
    """A worker node: this host's ranks, until the leader stops them or the group fails."""
    from multiprocessing import AuthenticationError

    from teacher_server.engine.node_worker import run_worker_node
    from teacher_server.logging_setup import setup_logging

    setup_logging(cfg.log_level, cfg.log_json)
    for note in notes:
        logging.getLogger("teacher_server").info("%s", note)
    try:
        code = run_worker_node(cfg)
    except ValueError as e:  # no key
        print(f"teacher-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except AuthenticationError:
        print("teacher-server: the leader refused this node's node_authkey (it must be the same on every node)",
              file=sys.stderr)
        raise SystemExit(2) from None
    except (OSError, EOFError) as e:  # the leader not reachable, or gone while greeting
        print(f"teacher-server: no connection to the leader at {cfg.master_addr}:{cfg.master_port}: {e}",
              file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
