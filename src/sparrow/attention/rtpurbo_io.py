"""RTPurbo calibration files beside a checkpoint: save, load, and an attention factory from a directory.

``<dir>/rtpurbo.json``: ``{"format": "sparrow-rtpurbo", "version": 2, "indexer_dim", "profile"
(HeadProfile.to_dict), "config" (RTPurboConfig fields, or null), "report"}``.
``<dir>/rtpurbo_indexer.safetensors``: ``layers.<l>.indexer_q`` [H_ret, q_per_kv * D, r],
``layers.<l>.indexer_k`` [H_ret, D, r] and ``layers.<l>.temperature`` [H_ret] (float32) for every layer with
retrieval heads.

Versions: 1 had no temperatures (its files load with temperature 1, the selection they were made for); 2 adds
them. A file of a later version than this reader knows is refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from sparrow.attention.base import LayerShape
from sparrow.attention.rtpurbo import (
    HeadProfile, IndexerWeights, RTPurboAttention, RTPurboConfig, indexer_temperature, rtpurbo_attention,
)

PROFILE_FILE = "rtpurbo.json"
INDEXER_FILE = "rtpurbo_indexer.safetensors"
FORMAT = "sparrow-rtpurbo"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
TENSOR_KINDS = ("indexer_q", "indexer_k", "temperature")

__all__ = ["INDEXER_FILE", "PROFILE_FILE", "load_rtpurbo", "rtpurbo_from_checkpoint", "save_rtpurbo"]


def save_rtpurbo(directory: str | Path, profile: HeadProfile, indexer: IndexerWeights, *,
                 config: RTPurboConfig | None = None, report: dict | None = None) -> Path:
    """Write the profile (JSON) and indexer (safetensors) into ``directory`` (created if needed); returns it.

    Raises: ValueError when the indexer lacks a layer the profile has retrieval heads in, covers another
    number of heads, or has a temperature that is not positive and finite.
    """
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for l in profile.retrieval.any(1).nonzero().flatten().tolist():
        if l not in indexer.q or l not in indexer.k:
            raise ValueError(f"layer {l} has retrieval heads but the indexer has no weights for it")
        n = len(profile.retrieval_heads(l))
        if indexer.q[l].shape[0] != n or indexer.k[l].shape[0] != n:
            raise ValueError(f"layer {l}: indexer covers {indexer.q[l].shape[0]} heads, profile marks {n}")
    tensors = {}
    for l in sorted(indexer.q):
        tensors[f"layers.{l}.indexer_q"] = indexer.q[l].detach().float().contiguous().cpu()
        tensors[f"layers.{l}.indexer_k"] = indexer.k[l].detach().float().contiguous().cpu()
        t = indexer_temperature(indexer.temperature.get(l), indexer.q[l].shape[0], l)
        tensors[f"layers.{l}.temperature"] = t.contiguous()
    save_file(tensors, str(d / INDEXER_FILE), metadata={"format": FORMAT, "version": str(FORMAT_VERSION)})
    doc = {"format": FORMAT, "version": FORMAT_VERSION, "indexer_dim": indexer.dim,
           "profile": profile.to_dict(), "config": dataclasses.asdict(config) if config else None,
           "report": report}
    tmp = d / (PROFILE_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(d / PROFILE_FILE)
    return d


def load_rtpurbo(directory: str | Path, *, with_config: bool = False):
    """Read what :func:`save_rtpurbo` wrote: ``(profile, indexer)``, or ``(profile, indexer, config)``
    with ``with_config`` (config None when none was saved).

    Raises: FileNotFoundError when either file is missing; ValueError on a foreign or inconsistent file, or a
    version this reader does not know.
    """
    from safetensors.torch import load_file

    d = Path(directory)
    pj, st = d / PROFILE_FILE, d / INDEXER_FILE
    for f in (pj, st):
        if not f.is_file():
            raise FileNotFoundError(f"{f} does not exist: run `sparrow calibrate` first")
    doc = json.loads(pj.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{pj} is not a Sparrow RTPurbo profile (format {doc.get('format')!r})")
    version = doc.get("version")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{pj} has format version {version!r}; this Sparrow reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))} (a newer Sparrow wrote it?)")
    profile = HeadProfile.from_dict(doc["profile"])
    tensors = load_file(str(st))
    indexer = IndexerWeights()
    kinds = TENSOR_KINDS if version >= 2 else TENSOR_KINDS[:2]
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in kinds:
            raise ValueError(f"unexpected tensor {name!r} in {st} (format version {version})")
        into = {"indexer_q": indexer.q, "indexer_k": indexer.k, "temperature": indexer.temperature}[parts[2]]
        into[int(parts[1])] = t
    for l in range(profile.num_layers):
        n = len(profile.retrieval_heads(l))
        if n and (l not in indexer.q or indexer.q[l].shape[0] != n):
            raise ValueError(f"{st} does not match the profile at layer {l}")
        if n and version >= 2 and (l not in indexer.temperature or indexer.temperature[l].shape != (n,)):
            raise ValueError(f"{st}: layer {l} needs a temperature for each of its {n} retrieval heads")
    if not with_config:
        return profile, indexer
    cfg = doc.get("config")
    return profile, indexer, (RTPurboConfig(**cfg) if cfg else None)


def rtpurbo_from_checkpoint(directory: str | Path, **overrides) -> Callable[[LayerShape], RTPurboAttention]:
    """An attention factory (``LayerShape -> RTPurboAttention``) from the files in ``directory``: the saved
    profile and indexer, the saved config (or the defaults) with ``overrides`` applied (e.g. ``top_p=0.95``).
    For recipe configs and :func:`sparrow.models.use_attention`."""
    profile, indexer, cfg = load_rtpurbo(directory, with_config=True)
    base = dataclasses.asdict(cfg) if cfg is not None else {}
    return rtpurbo_attention(profile, indexer, RTPurboConfig(**{**base, **overrides}))
