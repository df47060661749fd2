"""One validated configuration object for the whole service.

Sources, lowest to highest precedence: field defaults < YAML file < environment
(``TEACHER_SERVER_<FIELD>``) < command-line flags. Every field is documented in
``config.yaml`` at the repository root.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from teacher_server.did_you_mean import DTYPE_HINTS, did_you_mean
from teacher_server.env_names import ENV_PREFIX, ConfigError, check_env_names
from teacher_server.parallel_settings import ParallelSettings
from teacher_server.teachers import TeacherSettings

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs"]
AttentionBackend = Literal["auto", "sdpa", "varlen", "cudnn", "cudnn_fe", "flash_attn"]

NONE_WORDS = ("none", "null")  # an optional setting's None, in a flag or a variable
# vLLM's other spellings of the weight dtypes (its --dtype takes half and float too)
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
class Config(TeacherSettings, ParallelSettings):
    """Every setting of the service. Built once at startup, passed down explicitly."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    # --- model -------------------------------------------------------------------------
    model: str | None = Field(None, description="HF checkpoint directory (config.json + safetensors) or hub id "
                                                 "(org/name). None: built-in demo model.")
    revision: str | None = Field(None, description="Hub revision (branch, tag, commit) of a hub `model`; default main.")
    download_dir: str | None = Field(
        None, description="Hub cache for hub id models; default HF_HUB_CACHE (~/.cache/huggingface/hub).")
    served_model_name: str | None = Field(
        None, description="Name clients use in `model`; defaults to the model as given (its path or hub id).")
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto", description="dummy: random weights made in place from config.json (benchmarks).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weight dtype; auto: bf16 on GPU, fp32 on CPU.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when there is a GPU.")
    seed: int = Field(0, description="Seed of dummy weights.")
    demo_model_dir: str | None = Field(
        None, description="Where the demo checkpoint is written; default "
                          "$XDG_CACHE_HOME/teacher-server/demo-qwen3-v<N> (~/.cache when unset).")
    served_model_aliases: list[str] = Field(
        [], description="Further names accepted as `model` besides served_model_name (`--served-model-name a b` "
                        "as vLLM: the first is the served name, the others aliases; in a variable, comma-separated).")
    quantization: Literal["fp8"] | None = Field(
        None, description="fp8: quantize a bf16 checkpoint to FP8 e4m3 at load (per-row weight scales, per-token "
                          "activations; vLLM's flag). None: the checkpoint as it is (docs/fp8.md).")
    fp8_fast_accum: bool = Field(True, description="FP8 row-wise products in Hopper's fast accumulation (as vLLM's), "
                                                   "where checked; false: float32 promotions (docs/fp8.md).")

    # --- scoring contract --------------------------------------------------------------
    max_model_len: int | None = Field(
        None, ge=2, le=2**31 - 1, description="Longest accepted sequence; default the model's max_position_embeddings.")
    max_logprobs: int = Field(
        256, ge=-1, description="Largest K (candidates per row) and largest classic prompt_logprobs; -1: the "
                                "vocabulary's size (as vLLM's -1).")
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs", description="raw_logits: the matrix holds logits. processed_logprobs: a request's sampling "
                                    "temperature divides its logits before the softmax, as vLLM's mode of that name "
                                    "(0 and absent: 1).")
    max_rows_x_k: int = Field(64 * 1024 * 1024, ge=1, description="Cap on rows*K of one result matrix.")
    max_prompt_logprobs_entries: int = Field(
        512 * 1024, ge=1, description="Cap on the entries of classic prompt_logprobs in one response, "
                                       "(len(token_ids) - 1) * (prompt_logprobs + 1), each about 70 bytes of JSON; "
                                       "400 beyond.")

    # --- engine ------------------------------------------------------------------------
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget of one forward step; default on a GPU 32768 where its "
                                  "activations take at most 40% of the memory left after the weights and the KV "
                                  "pool still holds 4 steps, else 16384; 2048 on CPU.")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one step.")
    whole_sequence_fill: float = Field(
        0.5, ge=0.0, le=1.0, description="Once a step holds this share of its token budget, a waiting sequence that "
                                         "would be split to fill the rest but fits a step of its own waits for the "
                                         "next step (first in line there), and shorter ones behind it fill this step "
                                         "whole (a split sequence's second chunk attends over the first's keys on a "
                                         "slower path). 1: always split to fill.")
    logits_chunk_rows: int = Field(
        4096, ge=1, description="Scored rows per LM-head chunk: bounds float32 logits memory.")
    block_size: int = Field(16, ge=1, description="Tokens per paged-KV block.")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV pool size in blocks; default sized from free memory.")
    linear_state_slots: int = Field(
        0, ge=0, description="Linear-attention state slots of hybrid models (Qwen3.5): one per sequence processed in "
                             "chunks and one per prompt snapshot kept for prefix reuse. 0: 2 * max_num_seqs, cut down "
                             "to a quarter of the pool's memory; at least 2 either way. The KV blocks take the rest.")
    gpu_memory_utilization: float = Field(0.90, gt=0.0, le=1.0, description="Share of GPU memory the process may use.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of shared prompts (rows before the start).")
    attention_backend: AttentionBackend = Field(
        "auto", description="auto: cudnn_fe on GPU where nvidia-cudnn-frontend is installed, else cudnn; sdpa on CPU.")
    compile: bool = Field(
        True, description="torch.compile the norm/rotary stages on CUDA; our CUDA kernels run either way (a failed "
                          "compile falls back for the compiled stages alone).")
    pipeline: bool = Field(True, description="Schedule and launch step N+1 while step N runs on the GPU.")
    warm_up: bool | None = Field(
        None, description="Score a few synthetic requests at start-up (full-budget steps, a sequence carried "
                          "across chunks, a prompt shared by two responses, a lone short one), so one-time kernel "
                          "compiles, autotuning and plan builds happen before the first request; nothing they "
                          "leave is kept. None: on CUDA, off on the CPU.")
    deterministic: bool = Field(False, description="Same request gives the same bits whatever else is batched with it.")
    step_trace: str | None = Field(
        None, description="Append one JSON line per forward step to this file (when it was launched, its tokens, "
                          "sequences, chunks continuing or continued in another step, scored rows, host launch "
                          "and GPU time): for looking into throughput. None: off.")
    kv_cache_dtype: Literal["auto"] = Field(
        "auto", description="KV cache dtype: auto (the model's dtype) is the only one built; fp8 and others are "
                            "refused (vLLM's flag, accepted for launch scripts that pass auto).")
    compile_cache_dir: str | None = Field(
        None, description="Where compiled kernels and autotuning results are kept across restarts (torch "
                          "inductor's and Triton's caches, Triton autotuning; set explicitly, our CUDA kernel "
                          "library too): a restart "
                          "with it kept skips those compiles. None: $XDG_CACHE_HOME/teacher-server/compile "
                          "(~/.cache when unset); off: leave the libraries' own defaults (often /tmp).")

    # --- replicas ----------------------------------------------------------------------
    data_parallel_size: int = Field(
        1, ge=1, description="Engine replicas behind one port, each a process of its own on its own GPU (GPU i of "
                             "CUDA_VISIBLE_DEVICES, or the CPU); 1: one engine, where engine_process says.")
    engine_process: bool | None = Field(
        None, description="With one replica, run the engine in a process of its own behind the HTTP front, as each "
                          "replica runs, instead of on a thread of the server process (the front's HTTP work never "
                          "holds the GIL the engine launches kernels with; requests and results cross a pipe). "
                          "None: on for an engine on one GPU (CUDA, tensor_parallel_size 1), off otherwise.")
    routing: Literal["affinity", "round_robin"] = Field(
        "affinity", description="How requests are spread over replicas: affinity sends requests with the same unscored "
                                "prefix to the same replica (spilling when it is overloaded); round_robin does not.")
    routing_spill_tokens: int = Field(
        8192, ge=0, description="A new prefix leaves its preferred replica when that one's outstanding tokens "
                                "exceed the least-loaded replica's by more than this many.")
    replica_restart_backoff_s: float = Field(
        2.0, ge=0, description="Delay before a failed replica restarts (doubled after quick failures, up to 64x).")
    heartbeat_timeout_s: float = Field(
        10.0, ge=2, description="A replica silent this long (it beats each second: stopped or hung) is killed.")
    replica_start_timeout_s: float = Field(
        1800.0, ge=0, description="A replica not ready this long after it started (hung load) is killed; 0: no limit.")

    # --- server ------------------------------------------------------------------------
    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    api_key: str | None = Field(None, description="Require `Authorization: Bearer KEY`; also TEACHER_SERVER_API_KEY.")
    auth_exempt_health: bool = Field(True, description="/health and /livez answer without the API key.")
    auth_exempt_metrics: bool = Field(True, description="/metrics answers without the API key.")
    max_body_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="Larger request bodies get 413.")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a connection has to send a request's line and headers; then it is closed.")
    body_timeout_s: float = Field(60.0, gt=0, description="Time to receive a whole request body; 408 beyond.")
    send_timeout_s: float = Field(
        60.0, gt=0, description="Time the connection's write buffer may stay full (a client reading none of its "
                                "answer, or under ~20 KB/s) before the connection is aborted and the answer's bytes "
                                "freed.")
    body_read_slots: int = Field(
        4, ge=0, description="Large request bodies (256 KiB and up, or chunked) are read this many at a time, "
                             "first come first served, so that a burst of uploads reaches the engine as whole "
                             "requests from its start instead of all at its end, interleaved; a body waits at most "
                             "0.25 s for a slot, then reads anyway (slow senders cannot hold the others back). "
                             "0: all at once.")
    max_queue_requests: int = Field(4096, ge=1, description="Admitted-but-unfinished requests; 429 beyond.")
    max_queue_tokens: int = Field(64 * 1024 * 1024, ge=1, description="Admitted-but-unfinished tokens; 429 beyond.")
    request_timeout_s: float | None = Field(None, gt=0, description="Per-request deadline (504); None waits forever.")
    shutdown_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM: 503 for new work; in-flight work finishes for at most this long, "
                                "the rest gets 503; then the process exits.")
    vllm_metric_names: bool = Field(
        True, description="Also export the vllm:* names that vLLM dashboards and autoscalers read.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_json: bool = Field(False, description="One JSON object per log line.")
    ssl_keyfile: str | None = Field(None, description="TLS: the private key file (PEM); with ssl_certfile: HTTPS.")
    ssl_certfile: str | None = Field(None, description="TLS: the certificate chain file (PEM).")
    root_path: str = Field(
        "", description="Path prefix the service is mounted under behind a proxy that strips it (ASGI root_path, "
                        "as vLLM's --root-path): links of /docs and openapi.json carry it.")
    allowed_origins: list[str] = Field(
        [], description="Browser origins allowed by CORS (e.g. https://a.example or *); empty: no CORS headers. "
                        "vLLM's flag takes a JSON list; a comma-separated variable works too.")
    max_inflight_bytes: int = Field(
        2 * 1024 ** 3, ge=1024 * 1024, description="Bytes all requests in flight hold together (bodies being read "
                                                   "x2, arrays, results until sent); 429 with Retry-After beyond.")
    max_queue_wait_s: float | None = Field(
        60.0, gt=0, description="429 with Retry-After when the tokens queued ahead of a request would take longer "
                                "than this at the measured throughput. None: off.")
    stall_timeout_s: float = Field(
        60.0, gt=0, description="An engine completing no step this long while it holds work is failed (the longest "
                                "legitimate step: ~4 s for 8B, ~17 s for 32B on an H200; docs/operations.md).")
    priority_limit: int = Field(1000, ge=0, description="Accepted `priority` values: -limit..limit (400 beyond).")

    @field_validator("model", "served_model_name", "api_key", "demo_model_dir", "step_trace", "ssl_keyfile",
                     "ssl_certfile", "compile_cache_dir", "node_authkey", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.strip() == "" else v

    @field_validator("api_key", mode="after")
    @classmethod
    def _sendable_key(cls, v: str | None) -> str | None:
        return None if v is None else sendable_api_key(v)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = DTYPE_ALIASES.get(v.strip().lower(), v.strip().lower())
            choices = [*typing.get_args(cls.model_fields["dtype"].annotation), *DTYPE_ALIASES]
            if v not in choices:
                raise ValueError(f"{v!r} is not a dtype{did_you_mean(v, choices, DTYPE_HINTS)} "
                                 f"(one of {', '.join(choices)})")
        return v

    @field_validator("max_model_len", "max_num_batched_tokens", "num_kv_blocks", mode="before")
    @classmethod
    def _suffixed(cls, v: Any) -> Any:
        # 32k / 32K as vLLM's flags take them, in a variable or the file too
        if isinstance(v, str) and v.strip() and v.strip()[-1] in "kmgtKMGT":
            from teacher_server.human_int import human_int

            return human_int(v)
        return v

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _kv_dtype(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() != "auto":
            raise ValueError(f"kv_cache_dtype={v[:40]!r} is not built: the KV cache is kept in the model's dtype; "
                             f"use auto (or leave the flag out)")
        return v

    @field_validator("served_model_aliases", "allowed_origins", mode="before")
    @classmethod
    def _list_from_text(cls, v: Any) -> Any:
        # a variable holds text: vLLM's JSON list (--allowed-origins '["*"]') or comma-separated names
        if isinstance(v, list | tuple):  # flag values: each may be one of those texts
            return [x for item in v for x in (cls._list_from_text(item) if isinstance(item, str) else [item])]
        if isinstance(v, str):
            text = v.strip()
            if text.startswith("["):
                try:
                    return yaml.safe_load(text)
                except yaml.YAMLError:
                    raise ValueError(f"{text[:80]!r} is not a JSON list") from None
            return [p.strip() for p in text.split(",") if p.strip()]
        return v

    @model_validator(mode="before")
    @classmethod
    def _served_names(cls, values: Any) -> Any:
        # `served_model_name: [a, b]` (vLLM's nargs="+" flag, a YAML list): a is the name, b an alias
        if isinstance(values, dict) and isinstance(values.get("served_model_name"), list | tuple):
            names = [str(n) for n in values["served_model_name"] if n is not None]  # (`--served-model-name a none`)
            values = {**values, "served_model_name": names[0] if names else None,
                      "served_model_aliases": [*names[1:], *(values.get("served_model_aliases") or [])]}
        return values

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name accepted as ``model``: the served name, then the aliases."""
        return (self.served_name, *(a for a in self.served_model_aliases if a != self.served_name))

    @property
    def served_name(self) -> str:
        """The name clients pass as ``model`` (known before the engine is built)."""
        return self.served_model_name or (self.model if self.model else "teacher-server-demo")

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.max_logprobs == 0:
            raise ValueError("max_logprobs must be at least 1, or -1 for no cap but the vocabulary")
        if self.load_format == "dummy" and self.model is None and not self.teachers:  # (each teacher's checked)
            raise ValueError("load_format=dummy needs a model directory with a config.json")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both ssl_keyfile and ssl_certfile")
        if self.nnodes > 1 and (self.data_parallel_size > 1 or self.teachers):
            raise ValueError("nnodes > 1 spreads one model over hosts: it takes neither data_parallel_size > 1 nor "
                             "several teachers (run one release per replica or teacher)")
        return self

    # ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, file: str | os.PathLike | None = None, env: dict[str, str] | None = None,
             overrides: dict[str, Any] | None = None) -> Config:
        """Merge defaults < YAML file < environment < overrides (CLI flags) and validate."""
        values: dict[str, Any] = {}
        if file is not None:
            path = Path(file)
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
            try:
                loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
                raise ConfigError(f"config file {path} is not YAML: {' '.join(str(e).split())[:300]}") from None
            if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
                raise ConfigError(f"config file {path} must hold a mapping of settings, each named by text")
            values.update(loaded)
        env = dict(os.environ) if env is None else env
        check_env_names(env, cls.model_fields)
        for name, field in cls.model_fields.items():
            key = ENV_PREFIX + name.upper()
            if key in env:
                value: Any = env[key]
                if value.strip().lower() in NONE_WORDS and type(None) in typing.get_args(field.annotation):
                    value = None  # as `--flag none`: the default of an optional setting
                values[name] = value
        for k, v in (overrides or {}).items():  # None: not given
            if v is not None:
                values[k] = v
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
        try:
            return cls(**values)
        except ValidationError as e:
            msgs = [f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
                    for err in e.errors()]
            raise ConfigError("invalid configuration: " + "; ".join(msgs)) from None


def sendable_api_key(key: str) -> str:
    """``key`` without surrounding ASCII whitespace (a key file's trailing newline), which no client
    can send (HTTP strips spaces and tabs from a header value); a key no client can send at all,
    a no-break space included, is a ConfigError (not stripped: it would become another key)."""
    key = key.strip(" \t\r\n")
    if not all(" " <= c <= "~" for c in key):
        raise ConfigError("api_key must be printable ASCII: a client sends it in an Authorization header")
    return key
