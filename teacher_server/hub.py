"""Model resolution: ``--model`` names a local checkpoint directory or a Hugging Face hub id.

A directory is used as it is. Anything else that reads as a hub id (``name`` or
``org/name``) is fetched with ``huggingface_hub.snapshot_download`` into the hub cache
(``download_dir``, else ``HF_HUB_CACHE``, else the library default), config, tokenizer files
and weights only: ``config.json`` (and the tokenizer files, for ``/v1/models``), then the
shards the ``model.safetensors.index.json`` names, or the top-level ``*.safetensors`` when
there is no index (repos that also ship a consolidated copy of the weights are not downloaded
twice). ``HF_TOKEN`` authenticates gated or private repos; with ``HF_HUB_OFFLINE=1`` nothing
goes over the network and the id must already be in the cache (the Helm chart's init
container fills it; the server then resolves offline).

``python -m teacher_server.hub ORG/NAME [--revision R] [--download-dir D]`` downloads
ahead of time and prints the snapshot directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# fetched beside config.json when the repo has them: the tokenizer identity /v1/models reports
# (teacher_server/client/tokenizer.py reads the same files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")
# `name` or `org/name` of letters, digits, '-', '_', '.' (the hub's own rule, minus its
# length and '--'/'..' corner cases, which the hub client checks itself).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelNotFoundError(ValueError):
    """``model`` is neither a checkpoint directory nor a hub id that could be fetched;
    the message says which and what to do."""


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, read now rather than at import."""
    return any(os.environ.get(k, "").strip().upper() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_like_path(model: str) -> bool:
    """Written as a filesystem path (absolute, ./, ../, ~) rather than a hub id."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")


def resolve_model(model: str, *, revision: str | None = None, download_dir: str | None = None,
                  weights: bool = True) -> Path:
    """The local checkpoint directory for ``model`` (a directory, or a hub id fetched into
    the hub cache). ``weights=False`` fetches config.json only (``load_format=dummy``).
    ``revision`` (branch, tag or commit) applies to hub ids only. Raises
    ModelNotFoundError with the reason when neither works."""
    revision, download_dir = revision or None, download_dir or None  # "" from the environment = unset
    path = Path(model).expanduser()
    if path.is_dir():
        if revision:
            log.warning("revision %r ignored: model %s is a local directory", revision, path)
        return path
    if path.exists():
        raise ModelNotFoundError(f"model {model!r} is a file, not a checkpoint directory (config.json + safetensors)")
    if looks_like_path(model) or not _REPO_ID.fullmatch(model):
        raise ModelNotFoundError(f"model {model!r}: no such directory, and not a Hugging Face hub id (org/name)")
    return _download(model, revision, download_dir, weights)


def _download(repo_id: str, revision: str | None, download_dir: str | None, weights: bool) -> Path:
    import huggingface_hub as hf
    from huggingface_hub import constants, errors

    cache_dir = download_dir or os.environ.get("HF_HUB_CACHE") or None
    offline = is_offline()
    where = cache_dir or constants.HF_HUB_CACHE
    log.info("model %s: resolving from the hub (revision %s, cache %s%s)", repo_id, revision or "main", where,
             ", offline" if offline else "")

    def fetch(rev: str | None, patterns: list[str]) -> Path:
        # ignore_patterns: only the repo's top level (fnmatch's `*` also matches '/').
        return Path(hf.snapshot_download(repo_id, revision=rev, cache_dir=cache_dir, local_files_only=offline,
                                         allow_patterns=patterns, ignore_patterns=["*/*"]))

    try:
        snap = fetch(revision, [CONFIG_FILE, INDEX_FILE, *TOKENIZER_FILES])
        if weights:
            # The first call pinned the commit: fetch the weights of that same commit.
            shards = _shards(snap)
            fetch(snap.name, shards if shards is not None else ["*.safetensors"])
    except errors.GatedRepoError as e:
        raise ModelNotFoundError(f"model {repo_id!r} is gated on the hub: accept its licence and set HF_TOKEN "
                                 f"({_first_line(e)})") from None
    except errors.RepositoryNotFoundError as e:
        raise ModelNotFoundError(f"model {repo_id!r}: no such directory, and no such hub repo (or it is private: "
                                 f"set HF_TOKEN) ({_first_line(e)})") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"model {repo_id!r} has no revision {revision!r} on the hub") from None
    except errors.LocalEntryNotFoundError as e:
        # huggingface_hub's own text suggests a code change (local_files_only=False): say what to run instead
        get = f"python -m teacher_server.hub {repo_id}" + (f" --revision {revision}" if revision else "")
        if offline:
            raise ModelNotFoundError(f"model {repo_id!r} is not in the hub cache {where} (HF_HUB_OFFLINE is set, "
                                     f"revision {revision or 'main'}: no complete snapshot of it): download it "
                                     f"first on a machine with network ({get}, with the same HF_HUB_CACHE), or "
                                     f"unset HF_HUB_OFFLINE") from None
        raise ModelNotFoundError(f"model {repo_id!r}: no such directory; the hub could not be reached and the hub "
                                 f"cache {where} has no complete snapshot of it (revision {revision or 'main'}): "
                                 f"check the network (HTTPS_PROXY), or download it on a machine with network "
                                 f"({get}, with the same HF_HUB_CACHE) "
                                 f"({_first_line(e)})") from None
    except errors.HFValidationError as e:
        raise ModelNotFoundError(f"model {repo_id!r}: no such directory, and not a valid hub id "
                                 f"({_first_line(e)})") from None
    except errors.HfHubHTTPError as e:
        raise ModelNotFoundError(f"model {repo_id!r}: hub request failed: {_first_line(e)}") from None
    _check_complete(repo_id, snap, weights)
    log.info("model %s: snapshot %s", repo_id, snap)
    return snap


def _shards(snap: Path) -> list[str] | None:
    """The weight files the index names, or None when the repo has no index."""
    index = snap / INDEX_FILE
    if not index.is_file():
        return None
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def _check_complete(repo_id: str, snap: Path, weights: bool) -> None:
    """Offline, snapshot_download returns the snapshot folder without listing it: say
    what is missing here rather than in the loader."""
    if not (snap / CONFIG_FILE).is_file():
        raise ModelNotFoundError(f"model {repo_id!r}: snapshot {snap} has no {CONFIG_FILE}")
    if not weights:
        return
    shards = _shards(snap)
    if shards is None:
        if not any(snap.glob("*.safetensors")):
            raise ModelNotFoundError(f"model {repo_id!r}: snapshot {snap} has no *.safetensors weights "
                                     "(only safetensors checkpoints are served)")
        return
    missing = [s for s in shards if not (snap / s).is_file()]
    if missing:
        raise ModelNotFoundError(f"model {repo_id!r}: snapshot {snap} misses {len(missing)} of {len(shards)} "
                                 f"weight shard(s), e.g. {missing[0]}; download it again with network access")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m teacher_server.hub",
                                description="Download a hub model (config + safetensors) into the hub cache.")
    p.add_argument("model", help="hub id (org/name) or a local directory")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument("--download-dir", help="hub cache directory (default: HF_HUB_CACHE)")
    p.add_argument("--config-only", action="store_true", help="fetch config.json only (load_format=dummy)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        snap = resolve_model(args.model, revision=args.revision, download_dir=args.download_dir,
                             weights=not args.config_only)
    except ModelNotFoundError as e:
        print(f"teacher-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(snap)


if __name__ == "__main__":
    main()
