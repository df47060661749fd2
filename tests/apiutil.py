"""Helpers for API tests: build bodies, decode results, check the error shape."""

from __future__ import annotations

import base64
import io

import numpy as np


def npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def decode(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)))


def body(token_ids, cands=None, start=None, **sp) -> dict:
    params = dict(sp)
    if cands is not None:
        params["prompt_logprob_token_ids"] = cands.tolist() if isinstance(cands, np.ndarray) else cands
    if start is not None:
        params["prompt_logprob_start"] = start
    return {"token_ids": list(map(int, token_ids)), "sampling_params": params}


def assert_error(resp, status: int, param: str | None = None, contains: str | None = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert len(err["message"]) < 600
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err


def raw_http(port: int, data: bytes, timeout: float = 60) -> bytes:
    """Send ``data`` as it is on a new connection to the local server; everything it answers
    until it closes the connection."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got
