"""The quantized self-drafter: the policy's own layers with weight-only quantized linears (torchao).

``QuantizedSelfDrafter(model, DrafterConfig(weight="int8"))`` builds a draft model that shares with the
target (no copies): token embeddings, every norm, RoPE tables, biases, the output projection (lm_head),
the attention backends and the KV cache. Only the transformer layers' linear weights (q/k/v/o projections
and the MLP) are quantized copies; with int8 (``fuse=True``) q/k/v are one linear and the MLP's gate/up
another, whose biases are copies refreshed with the weights (views of the target's fused biases when the target's
projections are fused, :func:`sparrow.models.fuse_projections_`). A target fused before or after the drafter is
built works either way: the target's parameters keep their objects, and draft copies of fused layers whose linears
became quantized compute them separately. ``int8`` uses Sparrow's weight-only int8 linear
(:class:`~sparrow.kernels.int8_linear.Int8Linear`: a Triton kernel on CUDA that reads the weight as int8);
``int4`` and ``fp8`` use torchao (torchao's own int8 weight-only linear goes through ATen's
``_weight_int8pack_mm``, which made a draft step slower than the bf16 step it was meant to undercut; see
docs/speculative.md). Optionally (``window=``) the draft attends to a window of the cache
(:class:`~sparrow.speculative.window.WindowedDraftAttention`), which makes a draft step's cost independent
of the context length.

After a weight sync (which updates the target's tensors in place) :meth:`QuantizedSelfDrafter.refresh`
re-quantizes every linear and copies the result into the existing quantized tensors' storages, so
compiled steps and captured CUDA graphs that read them stay valid.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchtune.modules import TransformerDecoder

from sparrow.attention.base import DecodeMeta
from sparrow.attention.dense import DenseAttention
from sparrow.kernels.int8_linear import Int8Linear
from sparrow.models.attention import attention_modules
from sparrow.models.fuse import FusedGateUpMLP, cat_bias, row_concat, unfuse_projections_
from sparrow.speculative.base import Drafter
from sparrow.speculative.window import WindowedDraftAttention

WeightFormat = Literal["int8", "int4", "fp8", "none"]


@dataclass(frozen=True)
class DrafterConfig:
    """How to build a :class:`QuantizedSelfDrafter`.

    Attributes:
        weight: linear-weight format of the draft: ``"int8"`` weight-only (per-channel, any device; Sparrow's
            kernel),
            ``"int4"`` weight-only (groupwise, CUDA + bfloat16), ``"fp8"`` weight-only (CUDA, compute
            capability >= 8.9), or ``"none"`` (share the target's weights; only ``window`` differs).
        group_size: int4 quantization group along the input dimension.
        window: if set, the draft attends only to the last ``window`` tokens plus ``sink`` first tokens of
            each sequence (dense caches only); ``None`` attends to everything, like the target.
        sink: first tokens always attended when ``window`` is set.
        fallback: when ``int4`` / ``fp8`` cannot run here, fall back to ``int8`` with a warning
            (``False``: raise).
        fuse: with ``int8``, quantize the q / k / v projections as one linear and the MLP's gate / up
            projections as another (four int8 launches per layer instead of seven: at decode-sized batches a
            step is bound by launches, not weight bytes). Per-output-channel scales make the fused codes
            identical to the separate ones.
    """

    weight: WeightFormat = "int8"
    group_size: int = 128
    window: int | None = None
    sink: int = 4
    fallback: bool = True
    fuse: bool = True

    def __post_init__(self) -> None:
        if self.weight not in ("int8", "int4", "fp8", "none"):
            raise ValueError(f"DrafterConfig.weight must be 'int8', 'int4', 'fp8' or 'none', got {self.weight!r}")
        if self.group_size < 1 or self.group_size & (self.group_size - 1):
            raise ValueError(f"DrafterConfig.group_size must be a power of two, got {self.group_size}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"DrafterConfig.window must be >= 1 or None, got {self.window}")
        if self.sink < 0:
            raise ValueError(f"DrafterConfig.sink must be >= 0, got {self.sink}")


def _torchao_config(fmt: str, group_size: int, version: int | None = None):
    from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig

    if fmt == "int4":
        kw = {} if version is None else {"version": version}
        return Int4WeightOnlyConfig(group_size=group_size, set_inductor_config=False, **kw)
    if fmt == "fp8":
        return Float8WeightOnlyConfig(set_inductor_config=False)
    raise AssertionError(fmt)  # pragma: no cover


def _quantize_weight(weight: torch.Tensor, config) -> torch.Tensor:
    """A quantized copy of one [out, in] weight through torchao's ``quantize_`` (the weight is not changed)."""
    from torchao.quantization import quantize_

    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    with warnings.catch_warnings():  # the tinygemm int4 fallback is torchao's deprecated version 1
        warnings.filterwarnings("ignore", message="Config Deprecation")
        quantize_(lin, config)
    return lin.weight


def _probe(config, device: torch.device, dtype: torch.dtype, shape=(256, 256)) -> str | None:
    """Why ``config`` cannot quantize and run a linear here (None: it can)."""
    try:
        w = torch.randn(shape, device=device, dtype=dtype) * 0.02
        qw = _quantize_weight(w, config)
        x = torch.randn(4, shape[1], device=device, dtype=dtype)
        with torch.no_grad():
            y = torch.nn.functional.linear(x, qw)
        if not torch.isfinite(y.float()).all():
            return "non-finite outputs"
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return f"{type(e).__name__}: {e}"


def resolve_weight_format(cfg: DrafterConfig, device: torch.device, dtype: torch.dtype) -> tuple[str, Any]:
    """(format actually used, torchao config or None: ``none`` and Sparrow's ``int8`` need none). int4 tries
    torchao's default kernel (fbgemm), then tinygemm; ``int4`` / ``fp8`` fall back to int8 (with a warning)
    when ``cfg.fallback``."""
    if cfg.weight == "none":
        return "none", None
    if cfg.weight == "int8":
        return "int8", None  # Sparrow's own kernel: runs everywhere
    candidates: list[tuple[str, int | None]] = {"int4": [("int4", None), ("int4", 1)],
                                                "fp8": [("fp8", None)]}[cfg.weight]
    tried = []
    for fmt, version in candidates:
        label = fmt if version is None else f"{fmt} (version {version})"
        try:
            config = _torchao_config(fmt, cfg.group_size, version)
        except Exception as e:  # noqa: BLE001 - an unknown option means "not available here"
            tried.append(f"{label}: {type(e).__name__}: {e}")
            continue
        why = _probe(config, device, dtype, shape=(256, max(256, cfg.group_size)))
        if why is None:
            return fmt, config
        tried.append(f"{label}: {why}")
    if cfg.fallback:
        warnings.warn(f"QuantizedSelfDrafter: weight={cfg.weight!r} is not available on {device} with {dtype} "
                      f"({'; '.join(tried)}); using int8 weight-only instead", RuntimeWarning, stacklevel=3)
        return "int8", None
    raise RuntimeError(f"QuantizedSelfDrafter: weight={cfg.weight!r} cannot run on {device} with {dtype}: "
                       + "; ".join(tried))


def copy_quantized_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a torchao quantized tensor into another of the same layout, leaf storage by leaf storage."""
    if type(dst) is not type(src):
        raise TypeError(f"cannot copy {type(src).__name__} into {type(dst).__name__}")
    if is_traceable_wrapper_subclass(dst):
        names, ctx = dst.__tensor_flatten__()
        names_src, ctx_src = src.__tensor_flatten__()
        if names != names_src or repr(ctx) != repr(ctx_src):
            raise ValueError(f"quantized layouts differ: {names}/{ctx} vs {names_src}/{ctx_src}")
        for n in names:
            copy_quantized_(getattr(dst, n), getattr(src, n))
    else:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"leaf tensors differ: {dst.dtype}{tuple(dst.shape)} vs {src.dtype}{tuple(src.shape)}")
        dst.copy_(src)


def leaf_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (possibly nested) tensor subclass is made of."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in leaf_tensors(getattr(t, n))]
    return [t]


class QuantizedSelfDrafter(Drafter):
    """Self-drafter: the target's layers with quantized linear weights, sharing everything else.

    Args:
        model: the target (a torchtune decoder with Sparrow attention, as given to the engine), on its
            device and dtype. It is not modified.
        config: weight format and attention window (default: int8 weight-only, full attention).

    Attributes:
        weight_format: the format in use (differs from ``config.weight`` after a fallback).
        last_refresh_s: wall time of the last :meth:`refresh` (seconds, device synchronised).

    Raises:
        ValueError: ``config.window`` with attention backends other than :class:`DenseAttention`.
        RuntimeError: the weight format cannot run here and ``config.fallback`` is False.
    """

    def __init__(self, model: TransformerDecoder, config: DrafterConfig | None = None) -> None:
        self.config = config or DrafterConfig()
        self.target = model
        attn = attention_modules(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_seq_len = model.max_seq_len
        if self.config.window is not None:
            bad = [i for i, a in enumerate(attn) if not isinstance(a.backend, DenseAttention)]
            if bad:
                raise ValueError(f"DrafterConfig.window needs DenseAttention backends; layers {bad[:4]} have others")
        self.weight_format, self._qconfig = resolve_weight_format(self.config, self.device, self.dtype)

        # copy the layer structure; share every parameter, buffer and module without linear weights
        memo: dict[int, Any] = {}
        for t in list(model.parameters()) + list(model.buffers()):
            memo[id(t)] = t
        for m in model.layers.modules():
            if not isinstance(m, nn.Linear) and not any(isinstance(c, nn.Linear) for c in m.modules()):
                memo[id(m)] = m
        self.layers = copy.deepcopy(model.layers, memo)
        # (name, the target's linears it is built from, the draft module); a fused module has several sources
        self._pairs: list[tuple[str, list[nn.Linear], nn.Module]] = []
        fused: set[str] = set()
        if self.weight_format == "int8" and self.config.fuse:
            fused = self._fuse_int8(model)
        for name, src in model.layers.named_modules():
            if isinstance(src, nn.Linear) and self._quantizable(src) and name not in fused:
                self._pairs.append((name, [src], self.layers.get_submodule(name)))
        with torch.no_grad():
            for i, (name, srcs, dst) in enumerate(self._pairs):
                if isinstance(dst, Int8Linear):
                    continue  # fused above
                src = srcs[0]
                if self.weight_format == "int8":  # swap the module: the bias stays the target's
                    new = Int8Linear(src.weight, src.bias)
                    parent, _, attr = name.rpartition(".")
                    setattr(self.layers.get_submodule(parent) if parent else self.layers, attr, new)
                    self._pairs[i] = (name, srcs, new)
                else:
                    dst.weight = nn.Parameter(_quantize_weight(src.weight, self._qconfig), requires_grad=False)
        # a target fused by fuse_projections_ shares its fused q / k / v and gate / up modules with these copies:
        # where the copies' linears became quantized ones, the copies compute them separately
        unfuse_projections_(self.layers, stale_only=True)
        if self.config.window is not None:
            for layer in self.layers:
                layer.attn.backend = WindowedDraftAttention(layer.attn.backend.shape, window=self.config.window,
                                                            sink=self.config.sink)
        self.tok_embeddings, self.norm, self.output = model.tok_embeddings, model.norm, model.output
        self.last_refresh_s = 0.0

    @torch.no_grad()
    def _fuse_int8(self, model: TransformerDecoder) -> set[str]:
        """Give each draft layer one int8 linear for q / k / v (``attn.qkv_proj``) and one for the MLP's gate /
        up (a :class:`FusedGateUpMLP`); returns the names of the target linears they replace. Layers whose
        modules do not have the expected shape keep separate linears."""
        replaced: set[str] = set()
        for i, (src_layer, dst_layer) in enumerate(zip(model.layers, self.layers)):
            a, d = src_layer.attn, dst_layer.attn
            if hasattr(d, "qkv_proj") and all(isinstance(getattr(a, n, None), nn.Linear)
                                              for n in ("q_proj", "k_proj", "v_proj")):
                srcs = [a.q_proj, a.k_proj, a.v_proj]
                d.qkv_proj = Int8Linear(row_concat([s.weight for s in srcs]), cat_bias(srcs))
                d.q_proj = d.k_proj = d.v_proj = None  # the fused module replaces them
                self._pairs.append((f"{i}.attn.qkv_proj", srcs, d.qkv_proj))
                replaced |= {f"{i}.attn.{n}" for n in ("q_proj", "k_proj", "v_proj")}
            m, dm = src_layer.mlp, dst_layer.mlp
            if all(isinstance(getattr(m, n, None), nn.Linear) for n in ("w1", "w2", "w3")):
                srcs = [m.w1, m.w3]
                gate_up = Int8Linear(row_concat([s.weight for s in srcs]), cat_bias(srcs))
                # w2 keeps its name: the per-linear pass below quantizes it like any other linear
                dst_layer.mlp = FusedGateUpMLP(gate_up, dm.w2, dm.activation)
                self._pairs.append((f"{i}.mlp.gate_up", srcs, gate_up))
                replaced |= {f"{i}.mlp.w1", f"{i}.mlp.w3"}
        return replaced

    def _quantizable(self, lin: nn.Linear) -> bool:
        if self.weight_format == "none":
            return False
        if self.weight_format == "int8":
            return True
        if self.weight_format == "int4":
            return lin.in_features % self.config.group_size == 0 and lin.out_features % 8 == 0
        if self.weight_format == "fp8":
            return lin.in_features % 16 == 0 and lin.out_features % 16 == 0
        return True

    # ------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantize every draft linear from the target's current weights, in place.

        The quantized tensors keep their storages (only their contents change), so CUDA graphs captured
        earlier stay valid. Shared tensors (embeddings, norms, biases, lm_head) need nothing: they are the
        target's. Time in :attr:`last_refresh_s`.
        """
        t0 = time.perf_counter()
        for _, srcs, dst in self._pairs:
            if isinstance(dst, Int8Linear):
                dst.requantize_(srcs[0].weight if len(srcs) == 1 else row_concat([s.weight for s in srcs]))
                if len(srcs) > 1 and dst.bias is not None:  # a copy, refreshed here (or a view: a no-op copy)
                    dst.bias.copy_(cat_bias(srcs))
            else:
                copy_quantized_(dst.weight, _quantize_weight(srcs[0].weight, self._qconfig))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_refresh_s = time.perf_counter() - t0

    def quantized_weights(self) -> dict[str, list[torch.Tensor]]:
        """The plain tensors holding each quantized linear's weight (int8 values, scales; torchao's leaves), by
        module name relative to ``model.layers``: what :meth:`refresh` rewrites in place."""
        return {name: [dst.qweight, dst.scale] if isinstance(dst, Int8Linear) else leaf_tensors(dst.weight)
                for name, _, dst in self._pairs}

    def weight_nbytes(self) -> int:
        """Bytes of weights a draft step reads: quantized layers, shared norms, embeddings / lm_head."""
        seen: set[int] = set()
        total = 0
        tensors = list(self.layers.parameters()) + list(self.norm.parameters())
        tensors += [t for _, _, d in self._pairs if isinstance(d, Int8Linear) for t in (d.qweight, d.scale)]
        tensors += [d.bias for _, srcs, d in self._pairs if len(srcs) > 1 and d.bias is not None]
        out = self.output
        tensors.append(out.tied_module.weight if hasattr(out, "tied_module") else out.weight)
        for p in tensors:
            for leaf in leaf_tensors(p):
                if leaf.data_ptr() not in seen:
                    seen.add(leaf.data_ptr())
                    total += leaf.numel() * leaf.element_size()
        return total

    # ------------------------------------------------------------------------------------ forward
    def forward_logits(self, tokens: torch.Tensor, caches: Any, meta: DecodeMeta) -> torch.Tensor:
        T = tokens.shape[1]
        pos = (meta.prefix_len + meta.cached_len)[:, None] + torch.arange(T, device=tokens.device)[None, :]
        pos = pos.clamp(max=self.max_seq_len - 1)  # scratch positions past the context are never emitted
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            h = h + layer.sa_scale(layer.attn.decode(layer.sa_norm(h), pos, caches[i], meta))
            h = h + layer.mlp_scale(layer.mlp(layer.mlp_norm(h)))
        return self.output(self.norm(h)).float()

    def __repr__(self) -> str:
        c = self.config
        win = "full" if c.window is None else f"window={c.window}, sink={c.sink}"
        return f"QuantizedSelfDrafter(weight={self.weight_format}, {win}, linears={len(self._pairs)})"

