"""TEACHER_SERVER_* environment variables: the settings' prefix, the variables that are not
settings, and the check that every other one names a setting."""

from __future__ import annotations

import re
from typing import Any

from teacher_server.did_you_mean import did_you_mean

ENV_PREFIX = "TEACHER_SERVER_"

# TEACHER_SERVER_* variables that are not settings (read by the kernel build and the benchmarks);
# any other TEACHER_SERVER_* variable that names no setting is refused (a misspelling)
OTHER_ENV = ("TEACHER_SERVER_EXT_DIR", "TEACHER_SERVER_CUDA_ARCH", "TEACHER_SERVER_COMMIT",
             "TEACHER_SERVER_PLAN_DIR", "TEACHER_SERVER_BENCH_ALLOW_CPU_CHECKPOINT")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


# Kubernetes' service links of a Service named teacher-server (TEACHER_SERVER_SERVICE_HOST,
# TEACHER_SERVER_PORT_8000_TCP_ADDR, ...): not settings, and not misspellings
_SERVICE_LINK = re.compile(ENV_PREFIX + r"(SERVICE_HOST|SERVICE_PORT(_\w+)?"
                           r"|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)")


def check_env_names(env: dict[str, str], fields: dict[str, Any]) -> None:
    """Refuse a TEACHER_SERVER_* variable that names no setting (a misspelling, which would
    otherwise be ignored silently: the chart's extraEnv makes that easy), with the closest name."""
    port = env.get(ENV_PREFIX + "PORT", "")
    if port.startswith(("tcp://", "udp://")):
        raise ConfigError(f"{ENV_PREFIX}PORT={port[:60]} is a Kubernetes service link (a Service named "
                          f"teacher-server in the namespace): set enableServiceLinks: false on the pod (the chart "
                          f"does), or set {ENV_PREFIX}PORT to the port to listen on")
    known = [ENV_PREFIX + name.upper() for name in fields]
    bad = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known and k not in OTHER_ENV
                 and not _SERVICE_LINK.fullmatch(k))
    if bad:
        hints = [f"{k}{did_you_mean(k.upper(), known)}" for k in bad]
        raise ConfigError(f"unknown environment variable(s): {'; '.join(hints)} (each TEACHER_SERVER_<FIELD> "
                          f"names a setting of config.yaml; unset it or fix its name)")
