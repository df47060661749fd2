"""Logging: plain text or one JSON object per line (``log_json``).

Client-supplied text (request ids, model names) reaches log messages; neither form lets it
start a line of its own: JSON escapes control characters, and the text form writes them as
escapes (``\\n``, ``\\x1b``), so one record is always one line (a traceback excepted)."""

from __future__ import annotations

import logging
import re
import sys

import orjson

# fields that records may carry (``extra=``) and the JSON form writes as members
RECORD_FIELDS = ("request_id", "status", "latency_s", "tokens", "rows", "reason")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # C0, DEL, C1 (0x9b: a terminal's CSI), separators
_JSON_RAW = re.compile(r"[\x7f-\x9f\u2028\u2029]")


def escape_control(text: str) -> str:
    """``text`` with control and line-separator characters written as escapes."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        for key in RECORD_FIELDS:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        # (orjson leaves DEL, C1 and the line separators raw: valid JSON, but a terminal acts on them)
        return _JSON_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", orjson.dumps(out).decode())


class TextFormatter(logging.Formatter):
    """The classic text line, its message escaped (a traceback still follows on its own lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_control(record.message)
        return super().formatMessage(record)


def setup_logging(level: str = "info", json: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
