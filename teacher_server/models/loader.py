"""Load an HF checkpoint directory (config.json + safetensors, sharded or not, with or
without an index file) into the model class of its architecture, each tensor into its
place (the fused QKV and gate/up parts included) through the owning layer's
``load_weight``; or make random weights in place (``dummy`` load format). A tensor its
weight format reads beside a weight (``<prefix>.weight_scale_inv``) goes to the layer of
``<prefix>.weight``; then each format finishes its layers (``process_after_load``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from teacher_server.layers.formats.base import TensorInfo, WeightFormat, extra_name
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.pipeline import WHOLE, PipelineStage
from teacher_server.models.registry import model_class
from teacher_server.models.spec import ModelSpec

log = logging.getLogger(__name__)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            why = "has no weight_map" if isinstance(e, KeyError) else f"is not a safetensors index: {e}"
            raise ValueError(f"{index} {why}"[:300] + " (an interrupted download? fetch it again, or remove it "
                             "to read every *.safetensors file of the folder)") from None
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"{index}: weight_map's values must be file names")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    # transformers' own names, where present: another export beside them (Mistral's
    # consolidated.safetensors) is not part of this checkpoint
    ours = [f for f in files if f.name == "model.safetensors" or re.fullmatch(r"model-\d+-of-\d+\.safetensors", f.name)]
    return ours or files


@contextlib.contextmanager
def open_checkpoint_file(f: Path, device: str = "cpu") -> Iterator[Any]:
    """``safe_open`` of one checkpoint file; a file it cannot read (truncated by an interrupted
    download or copy, corrupt, missing, unreadable) is a ValueError naming the file and what to
    do, instead of safetensors' bare "incomplete metadata"."""
    try:
        with safe_open(str(f), framework="pt", device=device) as sf:
            yield sf
    except (SafetensorError, OSError) as e:
        why = " ".join(str(e).split())[:200]
        if not f.exists():
            if f.is_symlink():  # (a Hugging Face cache snapshot: its blob gone, an interrupted or pruned download)
                raise ValueError(f"checkpoint file {f} is a link to {os.readlink(f)}, which is missing (a cache "
                                 f"snapshot whose blob was removed or never finished?): fetch it again") from None
            raise ValueError(f"checkpoint file {f} is missing (the folder's model.safetensors.index.json names "
                             f"it): fetch it again") from None
        if not f.is_file() or not os.access(f, os.R_OK):
            raise ValueError(f"checkpoint file {f} cannot be read by this process (user id {os.getuid()}): "
                             f"{'not a regular file' if not f.is_file() else 'no read permission'}") from None
        raise ValueError(f"checkpoint file {f} ({f.stat().st_size:,} bytes) cannot be read: {why}; it is "
                         f"truncated or corrupt (an interrupted download or copy?): fetch it again") from None


def read_slice(sf: object, name: str, sl: tuple[int, int, int] | None) -> torch.Tensor:
    """Tensor ``name`` of an open safetensors file, only the slice ``sl`` (dim, start, length)
    of it when given: a rank reads its shard, never the whole tensor."""
    if sl is None:
        return sf.get_tensor(name)
    part = sf.get_slice(name)
    dim, start, n = sl
    if len(part.get_shape()) <= dim:
        return sf.get_tensor(name)
    index = (slice(None),) * dim + (slice(start, start + n),)
    return part[index]


def checkpoint_place(model: nn.Module, hf_name: str, extras: tuple[str, ...],
                     aliases: dict[str, str] | None = None) -> tuple[str, str, str | None] | None:
    """(module path, parameter, fused part) of a checkpoint tensor, as the model maps it
    (``checkpoint_param``); an extra tensor of the weight format goes where its weight goes,
    under the extra's name (``aliases``: the name the layer holds a second spelling under)."""
    for suffix in extras:
        if hf_name.endswith("." + suffix):
            place = model.checkpoint_param(hf_name.removesuffix(suffix) + "weight")
            held = (aliases or {}).get(suffix, suffix)
            return None if place is None else (place[0], extra_name(place[1], held), place[2])
    return model.checkpoint_param(hf_name)


def checkpoint_name(model: nn.Module, name: str) -> str:
    """``lm_head.weight`` for our LM head's parameter (the name a user looks for in the
    checkpoint), else ``name``: the model's own name, close to the checkpoint's but not always
    one of them (a fused parameter gathers several tensors: q/k/v, gate/up)."""
    place = model.checkpoint_param("lm_head.weight")
    return "lm_head.weight" if place is not None and name == f"{place[0]}.{place[1]}" else name


# the NaN/inf bit patterns of the 1-byte floats: (mask, pattern) of a code's byte
_FP8_NONFINITE = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C),
                  torch.float8_e4m3fnuz: (0xFF, 0x80), torch.float8_e5m2fnuz: (0xFF, 0x80)}
if hasattr(torch, "float8_e8m0fnu"):  # (MXFP4's scales)
    _FP8_NONFINITE[torch.float8_e8m0fnu] = (0xFF, 0xFF)


@torch.no_grad()
def nonfinite(x: torch.Tensor, chunk: int = 1 << 26) -> list[torch.Tensor]:
    """Whether ``x`` holds a NaN or an infinity, as 0-d flags on its device (one per chunk of rows:
    a bounded temporary; read them all at once, one sync): floating tensors by value, 1-byte
    floats by their NaN/inf bit patterns; integer codes (packed FP4) hold none."""
    x = x.detach()
    if x.dim() == 0:
        x = x.reshape(1)
    code = _FP8_NONFINITE.get(x.dtype)
    if x.numel() == 0 or (code is None and not x.is_floating_point()):  # (an expert rank's empty slice)
        return []
    rows = max(1, chunk // max(1, x[0].numel()))
    flags = []
    for part in x.split(rows):
        if code is None:
            flags.append((~torch.isfinite(part)).any())
        else:
            flags.append((part.view(torch.uint8).bitwise_and(code[0]) == code[1]).any())
    return flags


def finish_formats(model: nn.Module) -> None:
    """Each weight-holding layer's format, once its tensors are filled."""
    for m in model.modules():
        fmt = getattr(m, "fmt", None)
        if isinstance(fmt, WeightFormat):
            fmt.process_after_load(m)
    if torch.cuda.is_available():  # tensors a format replaced: back to the driver, so the KV pool sized from free
        torch.cuda.empty_cache()   # memory gets what quantized weights saved


def load_model(path: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0, tp: TensorParallel = SINGLE,
               stage: PipelineStage = WHOLE) -> nn.Module:
    """The model of ``spec.architecture`` with its weights (unbound: see ``bind``); with
    tp > 1 this rank's shard of it, read from the checkpoint slice by slice (each layer's
    ``checkpoint_slice``), or made at random per shard (``dummy``); with a pipeline ``stage``
    only that stage's layers (and embedding or head), the other stages' tensors not read."""
    path = Path(path)
    cls = model_class(spec.architecture)
    if load_format == "dummy":
        model = cls(spec, dtype, device, tied=bool(spec.tie_word_embeddings), tp=tp, stage=stage)
        init_dummy(model, seed + 1000 * tp.rank + 100_000 * stage.stage)
        finish_formats(model)
        return model
    files = checkpoint_files(path)
    tensors: dict[str, TensorInfo] = {}  # every tensor's dtype and shape, from the files' headers
    for f in files:
        with open_checkpoint_file(f) as sf:
            for n in sf.keys():
                info = sf.get_slice(n)
                tensors[n] = TensorInfo(info.get_dtype(), tuple(info.get_shape()), f)
    names = set(tensors)
    # config.json decides when it says; an untied model without lm_head.weight is then an error
    # (missing weights below), a tied one with it ignores it (as vLLM)
    # (or a vision-language checkpoint's text head: language_model.lm_head.weight)
    has_head = bool(names & {"lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight"})
    tied = spec.tie_word_embeddings is True or (spec.tie_word_embeddings is None and not has_head)
    if spec.tie_word_embeddings is True and has_head:
        log.warning("tie_word_embeddings is true: the checkpoint's lm_head.weight is ignored (the embedding is used)")
    model = cls(spec, dtype, device, tied=tied, tp=tp, stage=stage)
    if hasattr(model, "check_checkpoint"):  # a family's own look at what the files hold
        model.check_checkpoint({n: info.shape for n, info in tensors.items()})
    given: dict[str, list[str]] = {}  # our parameter name -> the checkpoint tensors written into it
    fmt = model.weight_format
    extras = tuple(fmt.extras)  # suffixes read beside a weight (a layer kept unquantized has none)
    dev = "cpu" if device.type == "cpu" else str(device)
    readers = fmt.plan_load(model, tensors, dtype)  # tensors read otherwise than as they are, or skipped

    def fetch(name: str) -> torch.Tensor:
        with open_checkpoint_file(tensors[name].file, dev) as other:
            return other.get_tensor(name)
    t_all = time.perf_counter()
    checks: list[torch.Tensor] = []  # each tensor's non-finite flags (nonfinite), and its name
    checked: list[str] = []
    for i, f in enumerate(files, 1):
        t0 = time.perf_counter()
        with open_checkpoint_file(f, dev) as sf:
            for hf_name in sf.keys():
                reader = readers.get(hf_name, read_slice)
                if reader is None:
                    continue
                place = checkpoint_place(model, hf_name, extras, fmt.aliases)
                if place is None or not model.on_stage(place[0]):  # (another pipeline stage's)
                    continue
                module, param, part = place
                try:
                    owner = model.get_submodule(module)
                except AttributeError:
                    owner = None
                if owner is None or not hasattr(owner, "load_weight") or getattr(owner, param, None) is None:
                    raise ValueError(f"checkpoint tensor {hf_name} has no place in {spec.architecture} "
                                     f"(config/weights mismatch)")
                if reader is read_slice:
                    raw, held = tensors[hf_name].dtype, getattr(owner, param).dtype  # (no format reads codes)
                    if fmt.name == "unquantized" and raw.startswith(("F8", "F4", "I", "U", "BOOL")) and \
                            held.is_floating_point:
                        raise ValueError(f"checkpoint tensor {hf_name} is {raw}, quantized codes, and config.json "
                                         f"names no quantization_config that says how to read them")
                    where = getattr(owner, "checkpoint_slice", None)
                    loaded = read_slice(sf, hf_name, where(param, part) if where is not None else None)
                else:  # read whole, then as the format says (the layer cuts its slice)
                    loaded = reader(sf.get_tensor(hf_name), fetch)
                flags = nonfinite(loaded)
                checks += flags
                checked += [hf_name] * len(flags)
                owner.load_weight(param, loaded, part, hf_name)
                given.setdefault(f"{module}.{param}", []).append(hf_name)
        log.info("loaded checkpoint file %d/%d (%s, %.2f GB) in %.1fs", i, len(files), f.name,
                 f.stat().st_size / 1e9, time.perf_counter() - t0)
    missing, twice = [], []
    for name, _ in model.named_parameters():
        module, _, param = name.rpartition(".")
        want, got = model.get_submodule(module).shards(param), given.get(name, [])
        if len(set(got)) < want:  # (counted by name: a part given twice does not stand in for one missing)
            missing.append(name)
        if len(got) > len(set(got)) or len(set(got)) > want:
            twice.append(name)

    def lacking(n: str) -> str:  # a fused parameter names the tensors it has (q and v of q/k/v...)
        got = sorted(set(given.get(n, [])))
        return checkpoint_name(model, n) + (f" (given only {', '.join(got)})" if got else "")
    if twice:
        also = f"; and is missing weights for: {', '.join(lacking(n) for n in missing[:8])}" if missing else ""
        raise ValueError(f"checkpoint {path} gives these weights more than once (a tensor in two files, or under two "
                         f"names): {'; '.join(' + '.join(given[n]) for n in twice[:8])}{also}")
    if missing:
        named = [lacking(n) for n in missing[:8]]
        untied = " (config.json's tie_word_embeddings is false: the head is its own tensor)" \
            if "lm_head.weight" in named and spec.tie_word_embeddings is False else ""
        raise ValueError(f"checkpoint {path} is missing weights for: {', '.join(named)}"
                         + (" ..." if len(missing) > 8 else "") + untied)
    bad = list(dict.fromkeys(n for n, h in zip(checked, torch.stack(checks).tolist() if checks else []) if h))
    if bad:
        raise ValueError(f"checkpoint {path} holds NaN or infinite values in: {', '.join(bad[:8])}"
                         + (" ..." if len(bad) > 8 else "") + " (every score would be NaN: a corrupt download, or "
                         "an export that overflowed)")
    finish_formats(model)
    log.info("loaded %d checkpoint file(s) in %.1fs", len(files), time.perf_counter() - t_all)
    return model


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights made in place (like vLLM's --load-format dummy): norms at 1,
    matrices N(0, 0.02) so activations stay in a realistic range; a weight format's tensors
    as the format draws them (``WeightFormat.init_random``)."""
    params = list(model.named_parameters())
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        module, _, param = name.rpartition(".")
        owner = model.get_submodule(module)
        fmt = getattr(owner, "fmt", None)
        if isinstance(fmt, WeightFormat) and param != "bias":
            fmt.init_random(owner, param, gen)
        elif p.dim() == 1 and "bias" not in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
