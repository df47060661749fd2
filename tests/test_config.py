"""Config precedence (flags > env > file > defaults), validation, and config.yaml coverage."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from teacher_server.cli import config_from_args
from teacher_server.config import Config, ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_config_yaml_documents_every_setting() -> None:
    doc = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert set(doc) == set(Config.model_fields)
    Config.load(ROOT / "config.yaml", env={})  # and it loads as is


def test_precedence(tmp_path, monkeypatch) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("port: 1111\nmax_logprobs: 10\nlog_level: warning\n")
    monkeypatch.setenv("TEACHER_SERVER_PORT", "2222")
    monkeypatch.setenv("TEACHER_SERVER_MAX_LOGPROBS", "20")
    cfg = config_from_args(["serve", "--config", str(f), "--port", "3333"])
    assert cfg.port == 3333 and cfg.max_logprobs == 20 and cfg.log_level == "warning"
    assert Config.load(f, env={}).port == 1111
    assert Config.load(env={}).port == 8000


def test_invalid_values_name_the_field(tmp_path) -> None:
    with pytest.raises(ConfigError, match="max_logprobs"):
        Config.load(env={"TEACHER_SERVER_MAX_LOGPROBS": "0"})
    with pytest.raises(ConfigError, match="logprobs_mode"):
        Config.load(overrides={"logprobs_mode": "processed"}, env={})
    f = tmp_path / "bad.yaml"
    f.write_text("no_such_setting: 1\n")
    with pytest.raises(ConfigError, match="no_such_setting"):
        Config.load(f, env={})
    with pytest.raises(ConfigError, match="not found"):
        Config.load(tmp_path / "missing.yaml", env={})


def test_cli_flags_map_to_fields() -> None:
    cfg = config_from_args(["serve", "--model", "/m", "--host", "127.0.0.1", "--device", "cpu",
                            "--max-logprobs", "64", "--logprobs-mode", "raw_logits", "--served-model-name", "t",
                            "--no-enable-prefix-caching", "--deterministic"])
    assert (cfg.model, cfg.host, cfg.device, cfg.max_logprobs, cfg.logprobs_mode, cfg.served_model_name) == \
        ("/m", "127.0.0.1", "cpu", 64, "raw_logits", "t")
    assert cfg.enable_prefix_caching is False and cfg.deterministic is True


def test_unsupported_architecture_is_refused(tmp_path) -> None:
    import json

    from teacher_server.engine.engine import Engine
    from teacher_server.models.spec import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM"):
        Engine(Config(model=str(tmp_path), device="cpu"))


QWEN3_TINY = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64}


@pytest.mark.parametrize(("archs", "names_head"), [(["FooForCausalLM"], False),
                                                   (["Qwen3ForSequenceClassification"], True),
                                                   (["Qwen3Model"], True),
                                                   (["GPT2LMHeadModel"], False)])  # a head, of a family not built
def test_a_known_model_type_does_not_make_an_unbuilt_architecture_load(archs: list[str], names_head: bool) -> None:
    """A classifier, reward or base model of a built family would load as its causal LM and be
    scored with a head it does not have: only a config naming no architecture falls back to
    its model_type."""
    from teacher_server.models.spec import ModelSpec, UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=archs[0]) as e:
        ModelSpec.from_dict({**QWEN3_TINY, "architectures": archs})
    assert ("has no language-model head" in str(e.value)) == names_head
    assert ModelSpec.from_dict({**QWEN3_TINY, "architectures": []}).num_layers == 1
    assert ModelSpec.from_dict(QWEN3_TINY).num_layers == 1


def test_every_setting_has_a_flag_with_help_and_default(capsys) -> None:
    """Flags are generated from Config: each field has `--name-with-dashes` with its description
    as help text and its default, as `serve --help` shows them."""
    with pytest.raises(SystemExit):
        config_from_args(["serve", "--help"])
    squeezed = "".join(capsys.readouterr().out.split())  # help is wrapped at any width
    for name, field in Config.model_fields.items():
        assert field.description, f"{name} has no description (it is the flag's help)"
        flag = "--" + name.replace("_", "-")
        entry = "".join(f"{field.description} (default: {field.default})".split())
        assert flag in squeezed and entry in squeezed, name


def test_generated_flags_parse_to_typed_values(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("max_model_len: 512\nrequest_timeout_s: 3\n")
    cfg = config_from_args(["serve", "--config", str(f), "--max-model-len", "none", "--header-timeout-s", "2.5",
                            "--max-prompt-logprobs-entries", "1000", "--no-vllm-metric-names", "--compile",
                            "--body-timeout-s", "7"])
    assert cfg.max_model_len is None and cfg.request_timeout_s == 3.0  # `none` resets what the file set
    assert (cfg.header_timeout_s, cfg.body_timeout_s, cfg.max_prompt_logprobs_entries) == (2.5, 7.0, 1000)
    assert cfg.vllm_metric_names is False and cfg.compile is True
    with pytest.raises(SystemExit):
        config_from_args(["serve", "--max-num-seqs", "many"])
    with pytest.raises(SystemExit):
        config_from_args(["serve", "--attention-backend", "magic"])
    with pytest.raises(ConfigError, match="header_timeout_s"):
        config_from_args(["serve", "--header-timeout-s", "0"])


def test_settings_that_may_be_none_take_none_from_flags_and_the_environment(tmp_path, monkeypatch) -> None:
    """Optional booleans (``warm_up``, ``engine_process``: none lets the server decide) take
    ``--x`` / ``--no-x`` and ``--x none``; ``none`` in a variable is None too, and a flag's
    ``none`` beats a variable's value (``--api-key none`` turns off TEACHER_SERVER_API_KEY)."""
    f = tmp_path / "c.yaml"
    f.write_text("warm_up: false\nengine_process: true\n")
    cfg = config_from_args(["serve", "--config", str(f), "--warm-up", "none", "--engine-process", "none"])
    assert cfg.warm_up is None and cfg.engine_process is None
    assert config_from_args(["serve", "--warm-up"]).warm_up is True
    assert config_from_args(["serve", "--no-warm-up", "--engine-process", "false"]).engine_process is False
    with pytest.raises(SystemExit):
        config_from_args(["serve", "--warm-up", "maybe"])
    monkeypatch.setenv("TEACHER_SERVER_WARM_UP", "none")
    monkeypatch.setenv("TEACHER_SERVER_MAX_MODEL_LEN", "None")
    monkeypatch.setenv("TEACHER_SERVER_API_KEY", "secret")
    cfg = config_from_args(["serve", "--config", str(f)])
    assert cfg.warm_up is None and cfg.max_model_len is None and cfg.api_key == "secret"
    assert config_from_args(["serve", "--api-key", "none"]).api_key is None
    with pytest.raises(ConfigError, match="max_logprobs"):  # none only where a setting may be None
        Config.load(env={"TEACHER_SERVER_MAX_LOGPROBS": "none"})


def test_an_api_key_is_what_a_client_can_send(monkeypatch) -> None:
    """A key file's trailing newline (a Kubernetes Secret made --from-file) is dropped: HTTP strips
    a header value's surrounding whitespace, so no client could ever match it; a key a header
    cannot carry is refused."""
    assert Config.load(env={"TEACHER_SERVER_API_KEY": "k3y\n"}).api_key == "k3y"
    assert Config(api_key=" a b\t").api_key == "a b" and Config(api_key=" \n").api_key is None
    for bad in ("k\x00y", "k\ny", "kéy", "abc\u00a0", "\u2003abc"):  # (Unicode spaces are not stripped into another key)
        with pytest.raises(ConfigError, match="api_key must be printable ASCII"):
            Config.load(overrides={"api_key": bad})
    # a Config made in-process reads the variable at app creation, the same way
    from teacher_server.server.app import create_app

    monkeypatch.setenv("TEACHER_SERVER_API_KEY", "k3y\r\n")
    app = create_app(Config(device="cpu"))
    assert [m.kwargs["api_key"] for m in app.user_middleware if "api_key" in m.kwargs] == ["k3y"]


@pytest.mark.parametrize("content", [b"port: [1\n", b"port: \xff\xfe\n"])
def test_a_config_file_that_is_not_yaml_is_a_config_error(tmp_path, content: bytes) -> None:
    f = tmp_path / "bad.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match="is not YAML") as e:
        Config.load(f, env={})
    assert "\n" not in str(e.value)  # (one line: PyYAML's message spans several)


@pytest.mark.parametrize("content", ["1: x\n", "null: x\n", "[1, 2]\n"])
def test_a_config_file_of_other_than_named_settings_is_a_config_error(tmp_path, content: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    with pytest.raises(ConfigError, match="must hold a mapping of settings, each named by text"):
        Config.load(f, env={})


@pytest.mark.parametrize(("given", "ids"), [(["0,1"], ["0", "1"]), (["0", "1"], ["0", "1"]), ("2,3", ["2", "3"]),
                                            ("[0, 1]", ["0", "1"]), ([4, 5], ["4", "5"])])
def test_gpu_ids_read_alike_from_the_flag_a_variable_and_the_file(given, ids) -> None:
    """``--gpus 0,1`` (the flag's words) was one id '0,1'; a variable's and the file's were two."""
    assert Config.load(env={}, overrides={"gpus": given}).gpus == ids


def test_a_malformed_gpu_list_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"gpus: GPU ids '\[1,2': expected ids separated by commas"):
        Config.load(env={"TEACHER_SERVER_GPUS": "[1,2"})


def test_the_settings_the_probe_found_unchecked() -> None:
    """A heartbeat timeout under two beats killed healthy replicas; a max_model_len past int32
    failed after the port opened; `--served-model-name a none` served the alias 'None'; a
    lowercase variable's suggestion was another setting's."""
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        Config.load(env={}, overrides={"heartbeat_timeout_s": 0.3})
    with pytest.raises(ConfigError, match="max_model_len"):
        Config.load(env={}, overrides={"max_model_len": 10 ** 23})
    assert Config.load(env={}, overrides={"served_model_name": ["a", None]}).served_names == ("a",)
    with pytest.raises(ConfigError, match="did you mean 'TEACHER_SERVER_MAX_MODEL_LEN'"):
        Config.load(env={"TEACHER_SERVER_max_model_len": "1"})


def test_max_logprobs_minus_one_is_the_vocabulary(checkpoints) -> None:
    """``--max-logprobs -1`` (TRL's docs give it to vLLM): no cap but the vocabulary's size."""
    from teacher_server.llm import LLM
    from teacher_server.validation import BadRequest, build_request

    assert config_from_args(["serve", "--max-logprobs", "-1"]).max_logprobs == -1
    for bad in ("0", "-2"):
        with pytest.raises(ConfigError, match="max_logprobs"):
            config_from_args(["serve", "--max-logprobs", bad])
    llm = LLM(str(checkpoints["qwen3"]), device="cpu", max_model_len=64, num_kv_blocks=16, block_size=8,
              max_logprobs=-1)
    vocab = llm.engine.spec.vocab_size
    assert llm.limits.max_logprobs == vocab
    assert build_request(token_ids=[1, 2, 3], limits=llm.limits, prompt_logprobs=vocab).prompt_logprobs == vocab
    with pytest.raises(BadRequest, match="prompt_logprobs"):
        build_request(token_ids=[1, 2, 3], limits=llm.limits, prompt_logprobs=vocab + 1)


def test_teachers_from_file_flags_and_env(tmp_path, monkeypatch) -> None:
    """`teachers`: YAML entries, `--teachers NAME=MODEL,key=value ...` and a variable give the same
    teachers; the top-level settings are their defaults; GPUs are shared out in order."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    f = tmp_path / "c.yaml"
    f.write_text("max_model_len: 4096\nteachers:\n  - {name: math, model: /m/a, data_parallel_size: 2}\n"
                 "  - {name: code, model: /m/b, tensor_parallel_size: 2, dtype: bfloat16, max_model_len: 8192}\n")
    flags = config_from_args(["serve", "--max-model-len", "4096", "--teachers",
                              "math=/m/a,data_parallel_size=2",
                              "code=/m/b,tensor_parallel_size=2,dtype=bfloat16,max_model_len=8K"])
    repeated = config_from_args(["serve", "--max-model-len", "4096", "--teacher", "math=/m/a,data_parallel_size=2",
                                 "--teacher", "code=/m/b,tensor_parallel_size=2,dtype=bfloat16,max_model_len=8K"])
    assert repeated.teachers == flags.teachers
    # any engine setting passes through to its teacher alone (a weight format, here)
    fp8 = Config.load(overrides={"teachers": ["a=/m/a,quantization=fp8", "b=/m/b"]}, env={}).teacher_configs()
    assert [t.quantization for t in fp8] == ["fp8", None]
    named = Config.load(overrides={"teachers": ["qwen3-8b=/m/a,max-model-len=64"]}, env={}).teacher_configs()
    assert (named[0].served_name, named[0].max_model_len) == ("qwen3-8b", 64)  # a name is kept as written
    env = Config.load(env={"TEACHER_SERVER_MAX_MODEL_LEN": "4096", "TEACHER_SERVER_TEACHERS":
                           '[{name: math, model: /m/a, data_parallel_size: 2}, {name: code, model: /m/b, '
                           'tensor_parallel_size: 2, dtype: bfloat16, max_model_len: 8192}]'})
    for cfg in (Config.load(f, env={}), flags, env):
        got = [(t.served_name, t.model, t.data_parallel_size, t.tensor_parallel_size, t.dtype, t.max_model_len,
                t.gpus, t.engine_process) for t in cfg.teacher_configs()]
        assert got == [("math", "/m/a", 2, 1, "auto", 4096, ["0", "1"], True),
                       ("code", "/m/b", 1, 2, "bfloat16", 8192, ["2", "3"], True)], got
    one = Config.load(env={})
    assert one.teacher_configs() == [one]  # one teacher: the configuration itself


@pytest.mark.parametrize("teachers,needle", [
    (["a=/m/a", "a=/m/b"], "teachers[1]: the name 'a'"),
    (["a=/m/a,port=9000"], "teachers[0]: port is the service's"),
    (["a=/m/a,dtyp=float32"], "did you mean 'dtype'"),
    (["a=/m/a,tensor_parallel_size=0"], "teachers[0]: tensor_parallel_size"),
    (["justaname"], "not key=value"),
    (["a=/m/a,gpus=[0]", "b=/m/b,gpus=[0]", "c=/m/c"], None),  # named GPUs may be shared on purpose
])
def test_teachers_refused_with_the_entry_named(teachers, needle, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if needle is None:
        assert [t.gpus for t in Config.load(overrides={"teachers": teachers}, env={}).teacher_configs()] == \
            [["0"], ["0"], ["1"]]
        return
    with pytest.raises(ConfigError) as e:
        Config.load(overrides={"teachers": teachers}, env={})
    assert needle in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="belong"):
        Config.load(overrides={"teachers": ["a=/m/a"], "model": "/m/x"}, env={})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match="needs 2 GPU"):
        Config.load(overrides={"teachers": ["a=/m/a,data_parallel_size=2"]}, env={})
