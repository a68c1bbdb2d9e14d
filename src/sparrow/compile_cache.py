"""An on-disk cache of compiled code that the next run of the same configuration reuses, and that a run of any
other configuration never reads.

``torch.compile`` keeps what Inductor produced (FX graphs, AOTAutograd graphs, generated C++ / Triton kernels,
autotuning results) in one local cache directory per process, and Triton keeps its compiled kernels in another.
A :class:`CompileCache` gives both a directory of their own per *compile key*::

    <root>/compile/<digest>/key.json    what the entries were compiled for (the key, readable)
                           /inductor/   Inductor's local caches (TORCHINDUCTOR_CACHE_DIR)
                           /triton/     Triton's kernel cache (TRITON_CACHE_DIR, unless the user chose one)
    <root>/costs/<digest>.json           cost-model calibrations (sparrow.speculative.CostModel.calibrate)

The key names what compiled code depends on beyond what Inductor hashes itself: the torch, CUDA, Triton and
Sparrow versions, the device, and what the caller adds (the rollout engine: model architecture, attention
backends, drafter, dtype, capacity and batch buckets, :meth:`sparrow.rollout.RolloutEngine.compile_key`). Another
key is another directory, so an entry made for another version, device or shape is never looked at; the same
key finds what an earlier run of it compiled. Inductor checks its own entries on top (graph, inputs, config).

Inductor reads the directory from the environment when it compiles, so :meth:`CompileCache.activate` points the
whole process at one cache: the last one activated is where every later compilation reads and writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

import sparrow

KEY_FILE = "key.json"
_SET_BY_US: set[str] = set()  # the TRITON_CACHE_DIR values activate() chose (a user's own is never replaced)


def digest(key: Mapping[str, Any]) -> str:
    """A short stable hash (20 hex digits) of a JSON-serialisable mapping, independent of its key order."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def device_name(device: torch.device | str) -> str:
    """What compiled code for ``device`` depends on: the GPU's name and compute capability (``"NVIDIA H200
    sm90"``), or the CPU's architecture and core count."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    import platform

    return f"{device.type}-{platform.machine()}-{os.cpu_count()}"


def environment_key(device: torch.device | str) -> dict[str, str]:
    """The library versions and the device compiled code is specific to."""
    from importlib import metadata

    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "none"
    return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton,
            "sparrow": sparrow.__version__, "device": device_name(device)}


def module_signature(module: torch.nn.Module) -> str:
    """A digest of a module's architecture as compiled code sees it: every submodule's class and plain settings
    (numbers, strings, flags, dataclass configs: head counts, eps, RoPE base, attention configuration ...) and every
    parameter's and buffer's name, shape and dtype. Weight values are not part of it (compiled steps take them as
    inputs, so a weight update reuses the compiled code)."""
    parts = []
    for name, m in module.named_modules():
        settings = {k: _plain(v) for k, v in sorted(vars(m).items()) if not k.startswith("_") and k != "training"}
        parts.append(f"{name}:{type(m).__qualname__}:{sorted((k, v) for k, v in settings.items() if v is not None)}")
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        parts.append(f"{name}:{tuple(t.shape)}:{t.dtype}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _plain(value: Any) -> str | None:
    """``value`` as text when it is a plain setting (see :func:`module_signature`), else None."""
    if isinstance(value, (bool, int, float, str, torch.dtype)) or value is None:
        return repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return repr(tuple(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return repr(value)
    return None


def cache_counters() -> dict[str, int]:
    """This process's counts of Inductor FX-graph cache and AOTAutograd cache lookups so far
    (``fxgraph_cache_hit`` / ``_miss`` / ``_bypass``, ``autograd_cache_hit`` / ``_miss`` / ``_bypass``)."""
    from torch._dynamo.utils import counters

    out = {k: int(counters["inductor"][k]) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                                     "fxgraph_cache_bypass")}
    out.update({k: int(counters["aot_autograd"][k]) for k in ("autograd_cache_hit", "autograd_cache_miss",
                                                              "autograd_cache_bypass")})
    return out


class CompileCache:
    """The cache directory of one compile key under ``root`` (module docstring).

    Args:
        root: the cache's top directory (created on first use), e.g. a run's ``output_dir/compile_cache``.
        key: what the compiled code depends on, as ``name -> text``; :func:`environment_key` is added to it.
        device: the device the code is compiled for (its name and the library versions join the key).

    Raises:
        TypeError: ``root`` is not a path, or ``key`` not a mapping of strings. ValueError: ``root`` is empty, or
            ``key`` names a field of the environment key.
    """

    def __init__(self, root: str | os.PathLike, key: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"CompileCache root must be a path, got {type(root).__name__}")
        if not str(root):
            raise ValueError("CompileCache root must not be empty")
        if not isinstance(key, Mapping) or not all(isinstance(k, str) for k in key):
            raise TypeError(f"CompileCache key must be a mapping with string names, got {key!r}")
        env = environment_key(device)
        clash = sorted(set(key) & set(env))
        if clash:
            raise ValueError(f"CompileCache key names {clash}, which the environment key sets itself")
        self.root = Path(root)
        self.key: dict[str, str] = {**{k: str(v) for k, v in key.items()}, **env}

    def __repr__(self) -> str:
        return f"CompileCache({str(self.root)!r}, digest={self.digest})"

    @property
    def digest(self) -> str:
        return digest(self.key)

    @property
    def path(self) -> Path:
        """The directory of this key's compiled code: ``<root>/compile/<digest>``."""
        return self.root / "compile" / self.digest

    @property
    def costs_dir(self) -> Path:
        """Where cost-model calibrations are cached: ``<root>/costs`` (each file keyed by its own cost key)."""
        return self.root / "costs"

    @property
    def warm(self) -> bool:
        """Whether an earlier run compiled into this key's directory."""
        return (self.path / "inductor").is_dir() and any((self.path / "inductor").iterdir())

    def activate(self) -> Path:
        """Make this key's directory the process's Inductor cache directory (and Triton's, unless the user set
        ``TRITON_CACHE_DIR`` to a directory of their own), so that every compilation from here on reads and
        writes there; writes ``key.json`` beside it. Returns the directory.

        Raises:
            RuntimeError: the directory's ``key.json`` names another key (never expected: a digest collision or
                an edited file); its entries are not used.
        """
        path = self.path
        path.mkdir(parents=True, exist_ok=True)
        key_file = path / KEY_FILE
        if key_file.is_file():
            saved = json.loads(key_file.read_text()).get("key")
            if saved != self.key:
                raise RuntimeError(f"compile cache {path} holds entries for another key: {saved} (not {self.key})")
        else:
            tmp = key_file.with_suffix(f".{os.getpid()}.tmp")  # several ranks of one host may write it at once
            tmp.write_text(json.dumps({"key": self.key}, indent=1, sort_keys=True))
            tmp.replace(key_file)
        inductor = str(path / "inductor")
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != inductor:
            keep_triton = _users_triton_dir()
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
            if not keep_triton:
                os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
                _SET_BY_US.add(os.environ["TRITON_CACHE_DIR"])
            from torch._inductor.utils import clear_caches

            clear_caches()  # Inductor's in-memory lookups of the previous directory
        return path


def _users_triton_dir() -> bool:
    """Whether ``TRITON_CACHE_DIR`` holds a directory the user chose: not unset, not one :meth:`activate` set, and
    not the one Inductor derives from its own cache directory when it compiles its first Triton kernel."""
    current = os.environ.get("TRITON_CACHE_DIR")
    if current is None or current in _SET_BY_US:
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    try:
        return not Path(current).resolve().is_relative_to(Path(inductor).resolve())
    except OSError:  # pragma: no cover - an unreadable path: treat it as the user's
        return True
