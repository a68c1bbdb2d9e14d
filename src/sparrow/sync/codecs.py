"""The codecs (dense, COO, compact, auto), the encode core they share with :class:`~sparrow.sync.SyncSender`,
and the public :func:`encode` / :func:`apply_` (whose apply is :mod:`sparrow.sync.apply`'s, as the receiver's).

Everything works on bit patterns (int16 views of bf16 / fp16, int32 views of fp32): the changed set
is ``old_bits != new_bits``, values are raw bit patterns or bit-pattern differences, never floats.

Every built-in encode, of one tensor (:func:`encode`) or of a whole state in buckets (``SyncSender``), is the same
two calls: :func:`plan_encode` (a device scan that counts every slice's changes and sizes its compact body, then
*one* host read of those numbers, which sizes the buffers and picks each slice's codec) and :func:`write_jobs`
(the writer that puts every body at its offset of the caller's buffer while it updates the old bits and the
hashes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..kernels.common.impl import Impl
from ..kernels.sync import api as K
from ..kernels.sync.common import DEFAULT_SPAN_LOG2, bits_view, check_span_log2, combine_hash, element_bits
from ._util import align, cut_runs, public_impl
from .apply import apply_payload
from .base import CODEC_NAMES, Payload, WeightCodec

#: Names of the built-in codecs, which take the fused, bucketed fast path of ``SyncSender``.
BUILTIN_CODECS = ("auto", "compact", "coo", "dense")


# ---------------------------------------------------------------------------------------------------
# the encode core: plan (scan, one host read, codec per slice), then write
# ---------------------------------------------------------------------------------------------------

@dataclass
class SliceJob:
    """One slice to encode: flat bit views ``old`` / ``new`` (same dtype / length / device) and the
    position of the slice's first element in its tensor (hash positions are tensor positions)."""

    old: torch.Tensor
    new: torch.Tensor
    start: int = 0


@dataclass
class EncodePlan:
    """What :func:`plan_encode` decided and :func:`write_jobs` writes: the jobs grouped by element size (order
    kept), their device scans, and per job the change count, the compact body words and the body kind."""

    jobs: Sequence[SliceJob]
    span_log2: int
    groups: dict[tuple[int, bool], list[int]]  # (element size, aligned) -> job indices, in order
    scans: dict[tuple[int, bool], K.BlockScan]
    counts: list[int]
    words: list[int]
    kinds: list[str]  # "compact", "coo" or "dense": the body each job gets

    def sizes(self, k: int) -> dict[str, int]:
        """Body bytes of job ``k`` under each built-in codec."""
        n, eb = self.jobs[k].old.numel(), 8 * self.jobs[k].old.element_size()
        return {c: K.body_nbytes(c, n, self.counts[k], self.words[k], eb) for c in CODEC_NAMES}

    def nbytes(self, k: int) -> int:
        """Body bytes of job ``k`` under its kind."""
        return self.sizes(k)[self.kinds[k]]


def _aligned(j: SliceJob) -> bool:
    return all(t.data_ptr() % 16 == 0 and t.numel() % 8 == 0 for t in (j.old, j.new))


def pick_codec(codec: str, sizes: Mapping[str, int]) -> str:
    """The body kind of a slice: ``codec`` itself, or for ``"auto"`` the smallest body (ties: compact,
    then COO, then dense)."""
    if codec == "auto":
        return min(("compact", "coo", "dense"), key=lambda c: sizes[c])
    if codec not in CODEC_NAMES:
        raise ValueError(f"unknown codec {codec!r}; expected one of dense, coo, compact, auto")
    return codec


def plan_encode(jobs: Sequence[SliceJob], codec: str, *, span_log2: int = DEFAULT_SPAN_LOG2, impl: Impl = "auto",
                before_read: Callable[[], object] | None = None) -> EncodePlan:
    """Steps 1 and 2 of every built-in encode (:func:`encode` of one tensor, :class:`~sparrow.sync.SyncSender` of
    a state): scan the jobs, grouped by element size and 16-byte alignment (so that one odd tensor does not take
    the vector loads from the others), one launch per group and no host sync; call ``before_read`` (e.g. a timer
    mark); then the encode's *one* host read: every job's change count and compact body words, which size the
    buffers and pick each job's body kind (:func:`pick_codec` of ``codec``).

    Raises ``ValueError``: ``codec`` not a built-in name, a bad ``span_log2``, jobs the scan refuses."""
    if codec != "auto" and codec not in CODEC_NAMES:
        raise ValueError(f"unknown codec {codec!r}; expected one of dense, coo, compact, auto")
    check_span_log2(span_log2)
    groups: dict[tuple[int, bool], list[int]] = {}
    for k, j in enumerate(jobs):
        groups.setdefault((j.old.element_size(), _aligned(j)), []).append(k)
    scans = {key: K.scan_blocks([jobs[k].old for k in idx], [jobs[k].new for k in idx], span_log2=span_log2,
                                impl=impl)
             for key, idx in groups.items()}
    if before_read is not None:
        before_read()
    stat = [t for key in groups for t in (scans[key].counts, scans[key].words)]
    host = torch.cat(stat).tolist() if stat else []  # the host sync: the sizes of every body
    counts, words = [0] * len(jobs), [0] * len(jobs)
    at = 0
    for idx in groups.values():
        for r, k in enumerate(idx):
            counts[k], words[k] = int(host[at + r]), int(host[at + len(idx) + r])
        at += 2 * len(idx)
    plan = EncodePlan(jobs, span_log2, groups, scans, counts, words, [])
    plan.kinds = [pick_codec(codec, plan.sizes(k)) for k in range(len(jobs))]
    return plan


def write_jobs(plan: EncodePlan, idx: Sequence[int], out: torch.Tensor, offsets: Mapping[int, int], *,
               update_old: bool = False, hash_out: torch.Tensor | None = None,
               hash_rows: Mapping[int, int] | None = None, max_changes: int | None = None) -> None:
    """Step 3: write the bodies of the consecutive jobs ``idx`` (job ``k``'s kind at byte ``offsets[k]`` of
    ``out``), with one launch per group and run of at most ``max_changes`` changes (the writer's scratch is 4
    bytes per change). ``update_old`` moves each job's old bits to its new ones; ``hash_out`` (int32 ``[R, 2]``)
    row ``hash_rows[k]`` receives the hash change of job ``k``. No host sync."""
    want = set(idx)
    cap = max_changes if max_changes is not None else 1 << 62
    for key, gidx in plan.groups.items():
        pos = [r for r, k in enumerate(gidx) if k in want]
        if not pos:
            continue
        a, b = pos[0], pos[-1] + 1
        if b - a != len(pos):
            raise ValueError("write_jobs: the jobs of one call must be consecutive")
        jobs = [plan.jobs[k] for k in gidx]
        counts = [plan.counts[k] for k in gidx]
        words = [plan.words[k] for k in gidx]
        modes = [plan.kinds[k] for k in gidx]
        offs = [offsets.get(k, 0) for k in gidx]
        rows = [hash_rows.get(k, -1) if hash_rows is not None else -1 for k in gidx]
        for r0, r1 in cut_runs(counts[a:b], cap):  # runs of at most `cap` changes (at least one slice)
            K.write_bodies([j.old for j in jobs], [j.new for j in jobs], plan.scans[key], counts, words, modes, out,
                           offs, sub=(a + r0, a + r1), update_old=update_old,
                           hash_starts=[j.start for j in jobs] if hash_out is not None else None,
                           hash_out=hash_out, hash_rows=rows if hash_out is not None else None)


def slice_sizes(jobs: Sequence[SliceJob], *, span_log2: int = DEFAULT_SPAN_LOG2,
                impl: Impl = "auto") -> list[tuple[int, dict[str, int]]]:
    """Per job: the change count and the body bytes under each built-in codec (one scan, one host read;
    nothing is written)."""
    plan = plan_encode(jobs, "auto", span_log2=span_log2, impl=impl)
    return [(plan.counts[k], plan.sizes(k)) for k in range(len(jobs))]


# ---------------------------------------------------------------------------------------------------
# one payload: encode (its apply is apply.apply_payload)
# ---------------------------------------------------------------------------------------------------

def _check_pair(base: torch.Tensor, new: torch.Tensor) -> None:
    element_bits(base.dtype)
    if base.dtype != new.dtype:
        raise TypeError(f"dtype mismatch: base {base.dtype}, new {new.dtype}")
    if base.shape != new.shape:
        raise ValueError(f"shape mismatch: base {tuple(base.shape)}, new {tuple(new.shape)}")
    if base.device != new.device:
        raise ValueError(f"device mismatch: base {base.device}, new {new.device}")


def _encode(codec: str, base: torch.Tensor, new: torch.Tensor, with_hash: bool, impl: Impl,
            span_log2: int = DEFAULT_SPAN_LOG2) -> Payload:
    _check_pair(base, new)
    b = bits_view(base.detach().contiguous())
    x = bits_view(new.detach().contiguous())
    plan = plan_encode([SliceJob(b, x, 0)], codec, span_log2=span_log2, impl=impl)
    kind, nbytes = plan.kinds[0], plan.nbytes(0)
    out = torch.zeros(max(16, align(nbytes)), dtype=torch.uint8, device=b.device)
    write_jobs(plan, [0], out, {0: 0})
    extra: dict = {"sizes": plan.sizes(0)}
    if kind == "compact":
        extra["span_log2"] = span_log2
    target = combine_hash(K.hash_bits(x, 0, impl=impl)) if with_hash else None  # host sync: the target hash
    return Payload(codec=kind, dtype=base.dtype, shape=tuple(base.shape), nchanged=plan.counts[0],
                   data=out[:nbytes], target_hash=target, extra=extra)


# ---------------------------------------------------------------------------------------------------
# public codecs
# ---------------------------------------------------------------------------------------------------

class _BuiltinCodec(WeightCodec):
    """A built-in codec as a :class:`WeightCodec`. ``with_hash``: store the target hash in each payload;
    ``verify``: check it on apply; ``impl``: kernel implementation (``None``: deprecated ``"auto"``);
    ``span_log2``: block span of compact bodies. Given to :class:`~sparrow.sync.SyncSender`, only its name
    counts (the sender has its own ``with_hash`` / ``impl`` / ``span_log2``)."""

    name = "auto"

    def __init__(self, *, with_hash: bool = True, verify: bool = True, impl: Impl = "auto",
                 span_log2: int = DEFAULT_SPAN_LOG2) -> None:
        self.with_hash = with_hash
        self.verify = verify
        self.impl = public_impl(impl)
        self.span_log2 = check_span_log2(span_log2)

    def encode(self, base: torch.Tensor, new: torch.Tensor) -> Payload:
        return _encode(self.name, base, new, self.with_hash, self.impl, self.span_log2)

    def apply_(self, base: torch.Tensor, payload: Payload) -> None:
        apply_payload(base, payload, verify=self.verify, impl=self.impl)


class DenseCodec(_BuiltinCodec):
    """All new bit patterns (``numel * element_size`` bytes)."""

    name = "dense"


class CooCodec(_BuiltinCodec):
    """int32 positions + new bit patterns of the changed elements (``m * (4 + element_size)`` bytes)."""

    name = "coo"


class CompactCodec(_BuiltinCodec):
    """Per block of ``2**span_log2`` elements: Elias-Fano positions and Elias-gamma codes of the zig-zagged
    bit-pattern deltas, every block's size known from its change count and code lengths (format and measured
    sizes: ``docs/sync.md``)."""

    name = "compact"


class AutoCodec(_BuiltinCodec):
    """Smallest of compact / COO / dense per tensor slice."""

    name = "auto"


_REGISTRY: dict[str, type[_BuiltinCodec]] = {c.name: c for c in (DenseCodec, CooCodec, CompactCodec, AutoCodec)}


def builtin_codec_name(codec: object) -> str | None:
    """``codec``'s name if it is a built-in codec (a name in :data:`BUILTIN_CODECS`, or an instance of one of
    the built-in classes under its own name), else ``None`` (a user codec, or not a codec at all)."""
    if isinstance(codec, str):
        return codec if codec in _REGISTRY else None
    if isinstance(codec, _BuiltinCodec) and codec.name in _REGISTRY:
        return codec.name
    return None


def get_codec(codec: str | WeightCodec, **kwargs) -> WeightCodec:
    """A codec instance from a name (``"dense"``, ``"coo"``, ``"compact"``, ``"auto"``) or an instance."""
    if isinstance(codec, WeightCodec):
        return codec
    try:
        return _REGISTRY[codec](**kwargs)
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(_REGISTRY)}") from None


def encode(base: torch.Tensor, new: torch.Tensor, codec: str | WeightCodec = "auto", *,
           with_hash: bool = True, impl: Impl = "auto", span_log2: int = DEFAULT_SPAN_LOG2) -> Payload:
    """Encode the change from ``base`` to ``new`` (same shape, dtype in {bf16, fp16, fp32}, device).

    Neither tensor is modified. ``codec``: ``"auto"`` (default: smallest of compact / COO / dense),
    ``"compact"``, ``"coo"``, ``"dense"`` or a :class:`WeightCodec` instance. ``with_hash`` stores the
    hash of ``new``'s bits so :func:`apply_` can verify the result; ``impl``: kernel implementation
    (``None``: deprecated spelling of ``"auto"``); ``span_log2``: block span of a compact body (10..20).
    Raises ``TypeError`` (dtype) or ``ValueError`` (shape / device mismatch, unknown codec, bad ``impl`` or
    ``span_log2``).
    """
    impl = public_impl(impl)
    if isinstance(codec, WeightCodec):
        return codec.encode(base, new)
    if codec not in _REGISTRY:
        raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(_REGISTRY)}")
    return _encode(codec, base, new, with_hash, impl, check_span_log2(span_log2))


def apply_(base: torch.Tensor, payload: Payload, *, verify: bool = True, impl: Impl = "auto") -> None:
    """Apply a built-in codec's ``payload`` to ``base`` in place, bit-exactly (a user codec's payload goes
    through that codec's own ``apply_``).

    ``base``: contiguous tensor of the payload's dtype and shape holding the encoder's base bits. ``impl``:
    kernel implementation (``None``: deprecated spelling of ``"auto"``).
    Raises :class:`ShapeMismatchError`, :class:`CorruptPayloadError` (invalid body or indices, or not a built-in
    payload) or :class:`HashMismatchError` (``verify`` and the result's hash differs from the payload's target
    hash); ``ValueError`` (bad ``impl``). ``base`` is unchanged when an error is raised: bodies whose lengths,
    indices or block headers are wrong are refused before any write; a compact body whose block contents fail
    validation, or a result with the wrong hash, is undone bit for bit.
    """
    apply_payload(base, payload, verify=verify, impl=public_impl(impl))


def position_entropy_bits(n: int, m: int) -> float:
    """log2 C(n, m): bits needed to name which ``m`` of ``n`` positions changed (the positions' bound)."""
    if m <= 0 or m >= n:
        return 0.0
    return (math.lgamma(n + 1) - math.lgamma(m + 1) - math.lgamma(n - m + 1)) / math.log(2)


def empirical_entropy_bits(values: torch.Tensor) -> float:
    """Total order-0 entropy (bits) of a tensor of integer symbols (e.g. the bit-pattern deltas)."""
    if values.numel() == 0:
        return 0.0
    _, counts = torch.unique(values.cpu(), return_counts=True)
    p = counts.double() / values.numel()
    return float(-(counts.double() * torch.log2(p)).sum())


def codec_bytes(old: Sequence[torch.Tensor], new: Sequence[torch.Tensor], *, entropy: bool = True,
                slice_elems: int = 1 << 25) -> dict[str, float]:
    """Bytes of every built-in codec for the change ``old -> new`` (tensors paired in order), without encoding.

    Each pair is cut into slices of ``slice_elems`` elements, as :class:`~sparrow.sync.SyncSender` cuts tensors;
    one scan sizes every slice's body under each codec (:func:`slice_sizes`). Returns ``{"n", "m", "dense", "coo",
    "compact", "auto"}``: elements, changed elements, the bytes of each codec's bodies summed over the slices
    (``auto``: the smallest per slice). With ``entropy`` also ``"bound_positions"`` (bytes of log2 C(n, m) per
    tensor: naming the changed positions), ``"bound_positions_values"`` (that plus the order-0 entropy of the
    bit-pattern delta codes) and ``"pm1_fraction"`` (the share of delta codes 0 and 1, i.e. +-1 ULP).

    Raises ``TypeError`` (an unsupported dtype, or a pair of two dtypes) and ``ValueError`` (lists of two lengths,
    a pair of two shapes or devices, a tensor not contiguous).
    """
    pairs = []
    for o, x in zip(old, new, strict=True):
        _check_pair(o, x)
        ob, xb = bits_view(o), bits_view(x)
        pairs.append([(ob[s:s + slice_elems], xb[s:s + slice_elems], s) for s in range(0, ob.numel(), slice_elems)])
    jobs = [SliceJob(a, b, s) for p in pairs for a, b, s in p]
    enc = slice_sizes(jobs)
    out: dict[str, float] = {"n": sum(j.old.numel() for j in jobs), "m": sum(m for m, _ in enc)}
    for c in ("dense", "coo", "compact"):
        out[c] = sum(sz[c] for _, sz in enc)
    out["auto"] = sum(min(sz.values()) for _, sz in enc)
    if entropy:
        changes, i = [], 0  # the scan's change counts, per tensor (its slices are consecutive jobs)
        for p in pairs:
            changes.append(sum(m for m, _ in enc[i:i + len(p)]))
            i += len(p)
        pos_bits = sum(position_entropy_bits(sum(a.numel() for a, _, _ in p), m) for p, m in zip(pairs, changes))
        codes = [K.diff_records(a, b)[1] for p in pairs for a, b, _ in p]
        allc = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.int32)
        out["bound_positions"] = pos_bits / 8
        out["bound_positions_values"] = (pos_bits + empirical_entropy_bits(allc)) / 8
        out["pm1_fraction"] = float((allc <= 1).float().mean()) if allc.numel() else 0.0
    return out


__all__ = ["BUILTIN_CODECS", "AutoCodec", "CompactCodec", "CooCodec", "DenseCodec", "EncodePlan", "SliceJob",
           "apply_", "builtin_codec_name", "codec_bytes", "encode", "empirical_entropy_bits", "get_codec", "pick_codec",
           "plan_encode", "position_entropy_bits", "slice_sizes", "write_jobs"]
