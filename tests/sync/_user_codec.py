"""User codecs for the tests (imported by the tests and by the gloo worker script).

``XorDeltaCodec`` is a small but complete :class:`~sparrow.sync.WeightCodec` written only against the public
API: int32 positions of the changed bit patterns and the XOR of old and new bits there. The others are
deliberately broken versions of it (negative controls).
"""

from __future__ import annotations

import torch

from sparrow.sync import CorruptPayloadError, Payload, ShapeMismatchError, WeightCodec

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


class XorDeltaCodec(WeightCodec):
    """Positions (int32) of the elements whose bit patterns differ, then ``old ^ new`` at each of them."""

    name = "xor-delta"

    def encode(self, base: torch.Tensor, new: torch.Tensor) -> Payload:
        bd = _BITS[base.dtype]
        b, x = base.reshape(-1).view(bd), new.reshape(-1).view(bd)
        pos = torch.nonzero(b != x).reshape(-1)
        flips = (b[pos] ^ x[pos]).contiguous()
        body = torch.cat([pos.to(torch.int32).view(torch.uint8), flips.view(torch.uint8)])
        return Payload(self.name, base.dtype, tuple(base.shape), pos.numel(), body, extra={"v": 1})

    def _records(self, base: torch.Tensor, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        if base.dtype != payload.dtype or tuple(base.shape) != tuple(payload.shape):
            raise ShapeMismatchError(f"payload is for {payload.dtype}{list(payload.shape)}, target is "
                                     f"{base.dtype}{list(base.shape)}")
        m, es = payload.nchanged, base.element_size()
        if payload.data.numel() != m * (4 + es):
            raise CorruptPayloadError(f"xor-delta body of {payload.data.numel()} bytes for {m} changes")
        pos = payload.data[:4 * m].view(torch.int32).to(torch.int64)
        if m and (int(pos.min()) < 0 or int(pos.max()) >= base.numel()):
            raise CorruptPayloadError("xor-delta positions out of range")
        return pos, payload.data[4 * m:].view(_BITS[base.dtype])

    def apply_(self, base: torch.Tensor, payload: Payload) -> None:
        pos, flips = self._records(base, payload)
        bits = base.view(-1).view(_BITS[base.dtype])
        bits[pos] ^= flips


class OffByOneXorCodec(XorDeltaCodec):
    """Deliberately broken: applies each flip one element further on (wrapping around)."""

    def apply_(self, base: torch.Tensor, payload: Payload) -> None:
        pos, flips = self._records(base, payload)
        bits = base.view(-1).view(_BITS[base.dtype])
        bits[(pos + 1) % max(1, base.numel())] ^= flips


class WritesThenFailsCodec(XorDeltaCodec):
    """Deliberately broken: writes its flips, then raises (an ordinary exception, not a sync error)."""

    def apply_(self, base: torch.Tensor, payload: Payload) -> None:
        super().apply_(base, payload)
        if payload.nchanged:
            raise IndexError("codec bug after writing")
