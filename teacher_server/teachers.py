"""Several teachers behind one service: the ``teachers`` setting read from its forms (a YAML
list of mappings, ``NAME=MODEL,key=value,...`` texts from a flag or a variable, a JSON list)
and each teacher's own configuration made from it.

A teacher entry takes the keys of a single-teacher configuration; the top-level settings are
its defaults. The front's settings (address, TLS, body and byte limits, the API key, ...) are
the service's, one for all teachers, and refused in an entry; so are the top-level model
settings beside ``teachers`` (each teacher names its own)."""

from __future__ import annotations

import os
from typing import Any

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator

from teacher_server.did_you_mean import did_you_mean

# One per service: read by the HTTP front, never by a teacher's engine.
FRONT_KEYS = frozenset({
    "host", "port", "api_key", "auth_exempt_health", "auth_exempt_metrics", "max_body_bytes", "header_timeout_s",
    "body_timeout_s", "send_timeout_s", "body_read_slots", "max_inflight_bytes", "max_queue_wait_s",
    "request_timeout_s", "shutdown_timeout_s", "vllm_metric_names", "log_level", "log_json", "ssl_keyfile",
    "ssl_certfile", "root_path", "allowed_origins", "teachers"})
# A teacher's own, never a default for the others.
MODEL_KEYS = ("model", "revision", "served_model_name", "served_model_aliases")


class TeacherSettings(BaseModel):
    """The settings of several teachers, a part of ``config.Config`` (its base class)."""

    gpus: list[str] = Field(
        [], description="The GPUs (CUDA device ids) the replicas take, in order, each its tensor_parallel_size of "
                        "them; empty: those of CUDA_VISIBLE_DEVICES (all when unset). In a teacher of `teachers`: "
                        "that teacher's GPUs.")
    teachers: list[dict[str, Any]] = Field(
        [], description="Several teachers behind one service, each chosen by the requests' `model` (docs/teachers.md): "
                        "a list of mappings with the keys of a single-teacher configuration (model, name or "
                        "served_model_name, dtype, tensor_parallel_size, data_parallel_size, gpus, ...); the "
                        "top-level engine settings are their defaults. As flags: `--teacher NAME=MODEL,key=value,...` "
                        "per teacher; in a variable, that text or a JSON list. Empty: one teacher, the top-level "
                        "model.")

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_ids(cls, v: Any) -> Any:
        if isinstance(v, list | tuple) and all(isinstance(x, str) for x in v):  # the flag's words: "0,1" or "0 1"
            v = ",".join(v)
        if isinstance(v, str):  # a flag's or a variable's text: ids as CUDA_VISIBLE_DEVICES spells them
            try:
                v = yaml.safe_load(v) if v.strip().startswith("[") else v.split(",")
            except yaml.YAMLError:
                raise ValueError(f"GPU ids {v[:80]!r}: expected ids separated by commas, or a list [0, 1]") from None
        if isinstance(v, int) and not isinstance(v, bool):
            v = [v]
        if isinstance(v, list | tuple):  # (YAML's [0, 1]: numbers)
            return [str(x).strip() if isinstance(x, int | str) and not isinstance(x, bool) else x for x in v
                    if not (isinstance(x, str) and not x.strip())]
        return v

    @field_validator("teachers", mode="before")
    @classmethod
    def _teacher_specs(cls, v: Any) -> Any:
        return parse_teachers(v, set(cls.model_fields))

    @model_validator(mode="after")
    def _check_teachers(self) -> TeacherSettings:
        if self.teachers:
            self.teacher_configs()  # each teacher's settings validated now, its errors named
        return self

    def teacher_configs(self) -> list[Any]:
        """The configuration of each teacher served: this one alone, or one per ``teachers``
        entry (this one's settings as defaults)."""
        return teacher_configs(self)


def parse_teachers(value: Any, known: set[str]) -> Any:
    """The ``teachers`` setting as a list of mappings (``known``: the setting names); other
    shapes are left to the field's own validation (its message names the field)."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text.startswith("["):  # a JSON (YAML) list, as a variable holds it
            try:
                return parse_teachers(yaml.safe_load(text), known)
            except yaml.YAMLError:
                raise ValueError(f"{text[:80]!r} is not a JSON list") from None
        return [parse_spec(text, known)]
    if isinstance(value, list | tuple):
        return [parse_spec(v, known) if isinstance(v, str) else v for v in value]
    return value


def parse_spec(text: str, known: set[str]) -> dict[str, Any]:
    """``NAME=MODEL,key=value,...`` (one teacher as a flag gives it) -> its mapping; a value is
    read as YAML (numbers, booleans, lists: ``gpus=[2,3]``), and a comma inside brackets does
    not split."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out: dict[str, Any] = {}
    for i, part in enumerate(p.strip() for p in parts):
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"teacher {text[:80]!r}: {part[:40]!r} is not key=value (the form is "
                             f"NAME=MODEL,key=value,...)")
        name, key = key.strip(), key.strip().replace("-", "_")  # (--flag spellings of a setting)
        if i == 0 and key not in known and key != "name":  # NAME=MODEL: the name as written
            out["name"], out["model"] = name, val.strip()
            continue
        try:
            out[key] = yaml.safe_load(val) if val.strip() else None
        except yaml.YAMLError:
            out[key] = val.strip()
    return out


def teacher_configs(cfg: BaseModel) -> list[BaseModel]:
    """Each teacher's configuration: ``cfg`` alone without ``teachers``; else ``cfg``'s engine
    settings overridden by each entry's. A teacher runs in processes of its own
    (``engine_process`` on unless the entry says otherwise), so teachers never share a GIL.
    (``cfg`` is a ``config.Config``, which reads this module: its class is taken from it.)"""
    make = type(cfg)
    if not cfg.teachers:
        return [cfg]
    given = [k for k in MODEL_KEYS if k in cfg.model_fields_set and getattr(cfg, k) not in (None, [])]
    if given:
        raise ValueError(f"{', '.join(given)} belong(s) to each teacher when `teachers` is set: give them in its "
                         f"entry")
    # the front's settings are carried too (a teacher's processes log as the service does)
    base = cfg.model_dump(exclude={"teachers", *MODEL_KEYS})
    out: list[BaseModel] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(cfg.teachers):
        entry = dict(entry)
        if "name" in entry:
            if "served_model_name" in entry:
                raise ValueError(f"teachers[{i}]: name and served_model_name both given (they are one setting)")
            entry["served_model_name"] = entry.pop("name")
        front = sorted(set(entry) & FRONT_KEYS)
        if front:
            raise ValueError(f"teachers[{i}]: {', '.join(front)} is the service's (one for all teachers): set it at "
                             f"the top level")
        unknown = sorted(set(entry) - set(make.model_fields))
        if unknown:
            hints = [f"{k}{did_you_mean(k, list(make.model_fields))}" for k in unknown]
            raise ValueError(f"teachers[{i}]: unknown setting(s): {'; '.join(hints)}")
        values = {**base, "engine_process": True, "gpus": [], **entry}
        try:
            t = make(**values)
        except ValueError as e:  # (pydantic's ValidationError is one)
            errs = getattr(e, "errors", None)
            msg = "; ".join(_error_line(err) for err in errs()) if callable(errs) else str(e)
            raise ValueError(f"teachers[{i}]: {msg}") from None
        if t.nnodes > 1:  # (its workers would be waited for as the only teacher's are: for ever, beside others)
            raise ValueError(f"teachers[{i}]: nnodes > 1 spreads one model over hosts: not one of several teachers "
                             f"(run one release per teacher)")
        for name in t.served_names:
            if name in seen:
                raise ValueError(f"teachers[{i}]: the name {name!r} is teachers[{seen[name]}]'s too; give each "
                                 f"teacher its own `name`")
            seen[name] = i
        out.append(t)
    return _share_gpus(cfg, out)


def _error_line(err: dict[str, Any]) -> str:
    """One of pydantic's errors as ``field: message`` (the message alone for the whole entry's)."""
    where, text = ".".join(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, ")
    return f"{where}: {text}" if where else text


def _share_gpus(cfg: BaseModel, teachers: list[BaseModel]) -> list[BaseModel]:
    """Teachers without ``gpus`` of their own take the next GPUs in order, each its
    tensor_parallel_size x data_parallel_size of them, out of the service's (``gpus``, else
    CUDA_VISIBLE_DEVICES, else device ordinals), leaving out those a teacher names: two teachers
    never land on one GPU unless told to. On the CPU nothing is given."""
    named = {g for t in teachers if t.gpus for g in t.gpus}
    if cfg.gpus:
        pool = list(cfg.gpus)
    elif os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        pool = [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    else:  # ordinals, as many as asked for (the replicas say so at start-up when there are fewer)
        pool = [str(i) for i in range(sum(t.ranks_per_replica() * t.data_parallel_size for t in teachers)
                                      + len(named))]
    free = [g for g in pool if g not in named]
    out = []
    for i, t in enumerate(teachers):
        if t.gpus or t.device == "cpu" or "gpus" in cfg.teachers[i]:
            out.append(t)
            continue
        need = t.ranks_per_replica() * t.data_parallel_size
        if need > len(free):
            raise ValueError(f"teachers[{i}] ({t.served_name}) needs {need} GPU(s) and {len(free)} are left of "
                             f"{','.join(pool)}: give the teachers their `gpus`, or fewer replicas")
        out.append(t.model_copy(update={"gpus": free[:need]}))
        free = free[need:]
    return out
