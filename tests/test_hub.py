"""Hub ids as `model`: resolved offline from a hub cache the test lays out the way
huggingface_hub does (models--org--name/{blobs,snapshots/<sha>,refs/<name>}, snapshot files
symlinked to blobs), with HF_HUB_OFFLINE=1 so nothing here touches the network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hubutil import add_snapshot

from teacher_server import LLM
from teacher_server.hub import ModelNotFoundError, resolve_model

ROOT = Path(__file__).resolve().parents[1]
REPO = "acme/tiny-qwen3"
SHA_MAIN = "1" * 40
SHA_V2 = "2" * 40


@pytest.fixture(scope="module")
def sharded(checkpoints, tmp_path_factory) -> Path:
    """The qwen3 test checkpoint saved again in several shards with an index file."""
    import transformers as tf

    out = tmp_path_factory.mktemp("sharded")
    tf.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"]).save_pretrained(out, max_shard_size="300KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    return out


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return cache


def test_local_directory_is_used_as_is(checkpoints) -> None:
    d = checkpoints["qwen3"]
    assert resolve_model(str(d)) == d


def test_hub_id_resolves_from_the_cache(offline_cache: Path, sharded: Path) -> None:
    snap = add_snapshot(offline_cache, REPO, sharded, SHA_MAIN)
    assert resolve_model(REPO) == snap
    # a commit, a tag, and an explicit cache directory that wins over HF_HUB_CACHE
    other = offline_cache.parent / "other-cache"
    snap2 = add_snapshot(other, REPO, sharded, SHA_V2, refs=("main", "v2"))
    assert resolve_model(REPO, revision=SHA_V2, download_dir=str(other)) == snap2
    assert resolve_model(REPO, revision="v2", download_dir=str(other)) == snap2
    assert resolve_model(REPO, download_dir=str(other)) == snap2


def test_unresolvable_models_fail_clearly(offline_cache: Path, sharded: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE.*no complete snapshot") as e:
        resolve_model("acme/not-cached")
    assert "acme/not-cached" in str(e.value) and str(offline_cache) in str(e.value)
    # what to do, not huggingface_hub's advice to its callers
    assert "not in the hub cache" in str(e.value) and "unset HF_HUB_OFFLINE" in str(e.value)
    assert "python -m teacher_server.hub acme/not-cached" in str(e.value)
    assert "local_files_only" not in str(e.value)
    for path in ("/no/such/checkpoint", "./not-here", "~/not-here-either"):
        with pytest.raises(ModelNotFoundError, match="no such directory, and not a Hugging Face hub id"):
            resolve_model(path)
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face hub id"):
        resolve_model("acme/two words")
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model(str(a_file))
    # a snapshot that lost a shard names it instead of failing later in the loader
    shard = sorted(p.name for p in sharded.glob("*.safetensors"))[-1]
    add_snapshot(offline_cache, "acme/partial", sharded, SHA_MAIN, skip=(shard,))
    with pytest.raises(ModelNotFoundError, match=f"misses 1 of .* e.g. {shard}"):
        resolve_model("acme/partial")
    with pytest.raises(ModelNotFoundError, match="revision"):
        resolve_model(REPO, revision="no-such-tag")


def test_config_only_snapshot_serves_dummy_weights(offline_cache: Path, checkpoints) -> None:
    only_config = tuple(p.name for p in checkpoints["qwen3"].iterdir() if p.name != "config.json")
    snap = add_snapshot(offline_cache, REPO, checkpoints["qwen3"], SHA_MAIN, skip=only_config)
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        resolve_model(REPO)
    assert resolve_model(REPO, weights=False) == snap
    llm = LLM(REPO, load_format="dummy", device="cpu")
    scores = llm.score([3, 1, 4, 1, 5], [[1, 2]] * 4)
    assert scores.shape == (4, 2) and np.isfinite(scores).all()


def test_llm_by_hub_id_scores_like_the_directory(offline_cache: Path, sharded: Path, checkpoints) -> None:
    """The same weights by id (sharded, from the cache) and by directory (one file): the
    same scores, and the id is the served name, as vLLM names a hub model."""
    add_snapshot(offline_cache, REPO, sharded, SHA_MAIN)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=40).tolist()
    cands = rng.integers(0, 512, size=(30, 8)).tolist()
    by_dir = LLM(str(checkpoints["qwen3"]), device="cpu").score(tokens, cands, start=9)
    by_id = LLM(REPO, device="cpu")
    assert by_id.engine.served_model_name == REPO
    got = by_id.score(tokens, cands, start=9)
    assert got.shape == (30, 8)
    np.testing.assert_allclose(got, by_dir, rtol=0, atol=1e-5)


def test_download_command_honours_the_environment(offline_cache: Path, sharded: Path) -> None:
    """`python -m teacher_server.hub` in a fresh process (the chart's init container):
    HF_HUB_CACHE and HF_HUB_OFFLINE from the environment, the snapshot path on stdout."""
    snap = add_snapshot(offline_cache, REPO, sharded, SHA_MAIN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "teacher_server.hub", REPO], env=env, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(snap)
    missing = subprocess.run([sys.executable, "-m", "teacher_server.hub", "acme/absent"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "acme/absent" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr
