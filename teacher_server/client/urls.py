"""Base URLs as users write them. The clients post to ``base_url + /inference/v1/generate``; a
base URL copied with the endpoint path already on it (``http://host:8000/inference/v1/generate``)
would otherwise post to the path twice and get a bare 404, so that path is taken off."""

from __future__ import annotations

from teacher_server.client.protocol import GENERATE_PATH


def normalise_base_url(url: str) -> str:
    """``url`` without a trailing slash or a trailing endpoint path (``/inference/v1/generate``,
    ``/inference/v1``) or the spaces around it. Raises ValueError for a URL that is not http(s)://
    (httpx would say 'Request URL is missing an http:// or https:// protocol', or that it does not
    support another protocol, only at the first request)."""
    if not isinstance(url, str) or not url.strip().lower().startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http:// or https:// URL such as http://127.0.0.1:8000, got {url!r:.200}")
    out = url.strip().rstrip("/")
    for suffix in (GENERATE_PATH, GENERATE_PATH.rsplit("/", 1)[0]):
        if out.endswith(suffix):
            return out[: -len(suffix)].rstrip("/")
    return out
