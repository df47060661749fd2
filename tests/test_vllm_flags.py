"""vLLM's `vllm serve` flags on `teacher-server serve`, one-line usage errors, and the start-up
checks that run before the engine loads (misspelled variables, a port in use)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import free_port

from teacher_server import __version__
from teacher_server.cli import config_from_args, main
from teacher_server.config import Config, ConfigError
from teacher_server.human_int import human_int


def test_a_vllm_launch_line_parses() -> None:
    notes: list[str] = []
    cfg = config_from_args(["serve", "Qwen/Qwen3-8B", "-tp", "2", "-dp", "3", "--served-model-name", "a", "b",
                            "--dtype", "half", "--max-model-len", "32k", "--trust-remote-code", "--enforce-eager",
                            "--num-gpu-blocks-override", "100", "--enable-log-requests", "--disable-log-stats",
                            "--kv-cache-dtype", "auto", "--root-path", "/teacher",
                            "--allowed-origins", '["https://a.example", "https://b.example"]'], notes)
    assert (cfg.model, cfg.tensor_parallel_size, cfg.data_parallel_size) == ("Qwen/Qwen3-8B", 2, 3)
    assert cfg.served_names == ("a", "b") and cfg.served_model_name == "a"
    assert (cfg.dtype, cfg.max_model_len, cfg.compile, cfg.num_kv_blocks) == ("float16", 32000, False, 100)
    assert cfg.root_path == "/teacher" and cfg.allowed_origins == ["https://a.example", "https://b.example"]
    assert any("--trust-remote-code" in n for n in notes) and any("--disable-log-stats" in n for n in notes)
    assert config_from_args(["serve", "--dtype", "float"]).dtype == "float32"
    assert config_from_args(["serve", "--enforce-eager", "--compile"]).compile is True  # ours wins


def test_hf_token_sets_the_hub_token(monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    config_from_args(["serve", "--hf-token", "hf_abc"])
    import os

    assert os.environ.pop("HF_TOKEN") == "hf_abc"
    config_from_args(["serve", "--hf-token"])  # the saved login: nothing set
    assert "HF_TOKEN" not in os.environ


@pytest.mark.parametrize("text, value", [("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1m", 10**6),
                                         ("2M", 2 * 2**20), ("4096", 4096)])
def test_sizes_take_vllm_suffixes(text: str, value: int) -> None:
    assert human_int(text) == value
    assert config_from_args(["serve", "--max-num-batched-tokens", text]).max_num_batched_tokens == value
    assert Config.load(env={"TEACHER_SERVER_MAX_MODEL_LEN": text}).max_model_len == value


def test_binary_suffixes_take_whole_numbers() -> None:
    with pytest.raises(ValueError, match="decimals"):
        human_int("1.5K")
    with pytest.raises(ValueError, match="not an integer"):
        human_int("lots")


@pytest.mark.parametrize(("argv", "says"), [
    (["--max-model-len", "auto"], "'auto' (vLLM's length fitted to memory) is not taken here"),
    (["--max-model-len", "-1"], "'-1' (vLLM's length fitted to memory) is not taken here"),
    (["--max-num-batched-tokens", "lots"], "'lots' is not an integer (suffixes: 32k = 32000"),
])
def test_a_size_the_flags_do_not_take_says_why(argv: list[str], says: str, capsys) -> None:
    assert says in _main_error(["serve", *argv], capsys)


def test_the_model_given_twice_differently_is_refused() -> None:
    assert config_from_args(["serve", "/m", "--model", "/m"]).model == "/m"
    with pytest.raises(ConfigError, match="given twice"):
        config_from_args(["serve", "/m", "--model", "/n"])


def _main_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_usage_mistake_is_one_line(capsys) -> None:
    err = _main_error(["serve", "--attention-backend", "magic"], capsys)
    assert err.count("\n") == 1 and "--attention-backend" in err and "usage:" not in err, err
    err = _main_error(["serve", "--no-such-flag"], capsys)
    assert err.count("\n") == 1 and "--no-such-flag" in err, err


@pytest.mark.parametrize(("flag", "meant"), [("--max-logprbs", "--max-logprobs"), ("--modle", "--model"),
                                             ("--max-logprob", "--max-logprobs")])  # (a prefix is not taken for it)
def test_a_misspelt_flag_names_the_closest(capsys, flag: str, meant: str) -> None:
    err = _main_error(["serve", flag, "5"], capsys)
    assert err.count("\n") == 1 and f"{flag}; did you mean '{meant}'?" in err, err
    assert err.endswith("(see teacher-server serve --help)\n"), err  # (the command's flags are in its help)


@pytest.mark.parametrize(("spelling", "meant"), [("bf16", "bfloat16"), ("float64", "float32"), ("double", "float32")])
def test_a_dtype_not_built_names_the_nearest_that_is(capsys, spelling: str, meant: str) -> None:
    """float64 is nearest float16 by its letters; the dtype it means to ask for is float32."""
    err = _main_error(["serve", "--dtype", spelling], capsys)
    assert err.count("\n") == 1 and f"did you mean '{meant}'" in err, err


def test_a_choice_flag_lists_none_as_it_is_typed(capsys) -> None:
    err = _main_error(["serve", "--quantization", "awq"], capsys)
    assert err.count("\n") == 1 and "(choose from 'fp8', 'none')" in err, err
    assert config_from_args(["serve", "--quantization", "none"]).quantization is None


@pytest.mark.parametrize("argv", [["--dtype", "bfloat16"], ["-tp", "2", "/m"], ["--model=/m"]])
def test_flags_before_the_command_say_where_they_go(capsys, argv: list[str]) -> None:
    err = _main_error(argv, capsys)
    flag = argv[0].split("=")[0]
    assert err.count("\n") == 1 and f"{flag}: flags follow the command, as in `teacher-server serve {argv[0]}" in err, err


def test_serve_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == __version__


def test_an_unbuilt_kv_cache_dtype_is_refused(capsys) -> None:
    err = _main_error(["serve", "--kv-cache-dtype", "fp8"], capsys)
    assert "kv_cache_dtype" in err and "not built" in err and "auto" in err


def test_a_misspelled_variable_is_refused_with_the_closest_name(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TEACHER_SERVER_MAX_LOGPROB", "64")
    err = _main_error(["serve"], capsys)
    assert "TEACHER_SERVER_MAX_LOGPROB" in err and "'TEACHER_SERVER_MAX_LOGPROBS'" in err, err
    monkeypatch.delenv("TEACHER_SERVER_MAX_LOGPROB")
    monkeypatch.setenv("TEACHER_SERVER_EXT_DIR", "/tmp/x")  # read by the kernel build, not a setting
    assert Config.load().max_logprobs == 256


def test_every_variable_the_code_reads_is_a_setting_or_known() -> None:
    """A TEACHER_SERVER_* variable read by the package, the benchmarks or the examples is a setting
    or in OTHER_ENV: else setting it (as the benchmarks' own runs do) makes every server refuse to
    start as if it were a misspelling."""
    import re

    from teacher_server.env_names import OTHER_ENV

    root = Path(__file__).resolve().parents[1]
    read = re.compile(r"(?:environ(?:\.get)?\(?\[?|getenv\()\s*[\"'](TEACHER_SERVER_[A-Z0-9_]+)[\"']")
    found = {m.group(1) for d in ("teacher_server", "bench", "examples") for f in (root / d).rglob("*.py")
             for m in read.finditer(f.read_text())}
    known = {"TEACHER_SERVER_" + n.upper() for n in Config.model_fields} | set(OTHER_ENV)
    assert "TEACHER_SERVER_EXT_DIR" in found and found <= known, found - known


def test_a_port_in_use_is_named_before_the_engine_loads(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _main_error(["serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"], capsys)
    assert f"port {port}" in err and "--port" in err, err


NONLOCAL_BIND = Path("/proc/sys/net/ipv4/ip_nonlocal_bind")


@pytest.mark.parametrize(("host", "says"), [("no.such.host.invalid", "does not resolve"),
                                             ("192.0.2.1", "is not an address of this machine")])
def test_a_host_that_is_not_this_machines_is_named_as_such(capsys, host: str, says: str) -> None:
    if host[0].isdigit() and NONLOCAL_BIND.exists() and NONLOCAL_BIND.read_text().strip() != "0":
        pytest.skip("this host lets a socket bind to any address (net.ipv4.ip_nonlocal_bind)")
    err = _main_error(["serve", "--host", host, "--port", str(free_port()), "--device", "cpu"], capsys)
    assert err.count("\n") == 1 and says in err and "not free" not in err, err


def test_tls_files_that_do_not_load_are_one_line(tmp_path, capsys) -> None:
    for name in ("k.pem", "c.pem"):
        (tmp_path / name).write_text("not a PEM file\n")
    err = _main_error(["serve", "--port", "0", "--device", "cpu", "--ssl-keyfile", str(tmp_path / "k.pem"),
                       "--ssl-certfile", str(tmp_path / "c.pem")], capsys)
    assert err.count("\n") == 1 and "do not load as a PEM certificate and its private key" in err, err


def test_tls_needs_both_files_and_names_a_missing_one(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match="ssl_keyfile and ssl_certfile"):
        config_from_args(["serve", "--ssl-keyfile", "k.pem"])
    err = _main_error(["serve", "--port", "0", "--ssl-keyfile", str(tmp_path / "k.pem"), "--ssl-certfile",
                       str(tmp_path / "c.pem")], capsys)
    assert "no file" in err and "k.pem" in err, err


def test_aliases_cors_and_root_path_over_http(tmp_path) -> None:
    """Every --served-model-name is accepted as `model` (an unknown one is still 404); CORS
    answers a browser's preflight for an allowed origin only; /docs links carry root_path."""
    from apiutil import assert_error, body
    from conftest import LiveServer

    cfg = Config(demo_model_dir=str(tmp_path / "m"), device="cpu", max_num_batched_tokens=256, num_kv_blocks=256,
                 max_model_len=512, served_model_name=["teacher", "qwen-alias"],
                 allowed_origins=["https://ui.example"], root_path="/teacher")
    gen = "/inference/v1/generate"
    with LiveServer(cfg) as s, s.client() as c:
        for name in ("teacher", "qwen-alias"):
            r = c.post(gen, json={**body([1, 2, 3], [[4], [5]], start=0), "model": name})
            assert r.status_code == 200 and r.json()["model"] == "teacher", r.text
        assert_error(c.post(gen, json={**body([1, 2, 3], [4]), "model": "other"}), 404, "model")
        for name in ("teacher", "qwen-alias"):  # the trainers' endpoint takes every name too
            r = c.post("/v1/completions", json={"model": name, "prompt": [1, 2, 3], "max_tokens": 0,
                                                "echo": True, "prompt_logprobs": 1})
            assert r.status_code == 200, r.text
        assert c.post("/v1/completions", json={"model": "other", "prompt": [1, 2], "max_tokens": 0}).status_code == 404
        pre = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
        r = c.options(gen, headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
        r = c.options(gen, headers={**pre, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        assert "/teacher/openapi.json" in c.get("/docs").text


def test_cuda_without_a_gpu_is_one_line_in_every_engine_mode(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    for mode in ("--engine-process", "--no-engine-process"):
        err = _main_error(["serve", "--device", "cuda", mode, "--port", "0"], capsys)
        assert err.count("\n") == 1 and "no CUDA GPU" in err and "--device cpu" in err, err


def test_docs_cli_lists_every_flag() -> None:
    """docs/cli.md's flag table is the parser's (regenerate: python -m teacher_server.cli_reference --write),
    and its vLLM table names each vLLM flag this command takes."""
    from teacher_server.cli_reference import DOC, render, serve_parser
    from teacher_server.vllm_flags import ALIASES, NO_EFFECT

    doc = DOC.read_text()
    assert render(doc) == doc, "docs/cli.md's flag table is stale: python -m teacher_server.cli_reference --write"
    vllm_table = doc.split("## vLLM's flags", 1)[1].split("## Start-up errors", 1)[0]
    vllm = [o for a in serve_parser()._actions if a.dest.startswith("vllmflag_") for o in a.option_strings
            if not o.startswith("--no-")]
    vllm += [f for fs in ALIASES.values() for f in fs] + ["--" + n.replace("_", "-") for n in NO_EFFECT]
    vllm += ["--served-model-name", "--dtype", "--max-model-len", "--kv-cache-dtype", "--ssl-keyfile",
             "--ssl-certfile", "--root-path", "--allowed-origins"]
    for flag in vllm:
        assert f"`{flag}" in vllm_table, flag


def test_too_few_gpus_for_the_replicas_is_one_line(monkeypatch) -> None:
    import torch

    from teacher_server.engine.rank_setup import check_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_gpus("auto", 2, 1)
    with pytest.raises(RuntimeError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs 4 GPUs, 2 visible"):
        check_gpus("cuda", 2, 2)
    check_gpus("cpu", 2, 2)  # gloo processes on the CPU


def test_kubernetes_service_links_are_not_misspellings() -> None:
    links = {"TEACHER_SERVER_SERVICE_HOST": "10.0.0.1", "TEACHER_SERVER_SERVICE_PORT": "8000",
             "TEACHER_SERVER_SERVICE_PORT_HTTP": "8000", "TEACHER_SERVER_PORT_8000_TCP_ADDR": "10.0.0.1"}
    assert Config.load(env=links).port == 8000
    with pytest.raises(ConfigError, match="service link.*enableServiceLinks"):
        Config.load(env={**links, "TEACHER_SERVER_PORT": "tcp://10.0.0.1:8000"})
