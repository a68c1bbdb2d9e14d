"""SparseRL-Sync: bit-exact sparse trainer -> rollout weight sync.

Only the elements whose bit patterns changed are sent; the receiver reconstructs the sender's bits
exactly (bf16 / fp16 / fp32, NaN payloads and signed zeros included).

Single tensors::

    payload = sparrow.sync.encode(base, new, codec="auto")   # Payload (to_bytes / from_bytes)
    sparrow.sync.apply_(base, payload)                        # base now holds new's bits

State dicts (one process or across ``torch.distributed`` ranks)::

    sender = SyncSender({n: p.detach().to(torch.bfloat16) for n, p in trainer.named_parameters()},
                        bucket_bytes=256 << 20, anchor_every=50)
    receiver = SyncReceiver(dict(rollout.named_parameters()))
    stats = sender.send(dict(trainer.named_parameters()), transport)   # on the trainer
    receiver.receive(transport)                                        # on the rollout side

Your own codec: any :class:`WeightCodec` (``encode`` / ``apply_`` of one flat tensor slice) plugs in as
``SyncSender(named, codec=MyCodec())`` and ``SyncReceiver(named, codecs=[MyCodec()])``; it travels in the
same buckets with the same versions, hashes and all-or-nothing apply.

Projections of the sync time to other model sizes and links: :func:`project_sync` (``sparrow.sync.projection``);
synthetic and AdamW weight updates to measure with: ``sparrow.sync.synthetic``.

See ``docs/sync.md`` for the formats, the entropy bound and the kernel scheme.
"""

from .base import Payload, WeightCodec
from .bucket import BucketInfo, EntryMeta, build_bucket, parse_bucket
from .codecs import (
    AutoCodec,
    CompactCodec,
    CooCodec,
    DenseCodec,
    apply_,
    empirical_entropy_bits,
    encode,
    get_codec,
    position_entropy_bits,
)
from .errors import (
    CorruptPayloadError,
    HashMismatchError,
    OutOfOrderError,
    ReplayError,
    ResyncRequiredError,
    ShapeMismatchError,
    SyncError,
    TruncatedPayloadError,
    UnknownCodecError,
    VersionMismatchError,
)
from .fingerprint import state_fingerprint
from .projection import Projection, SyncRates, project_sync, rates_at
from .receiver import SyncReceiver
from .sender import SyncSender
from .stats import SyncStats
from .transport import DistributedTransport, FileTransport, InProcessTransport, Transport
from .warmup import warmup

__all__ = [
    "AutoCodec", "BucketInfo", "CompactCodec", "CooCodec", "CorruptPayloadError", "DenseCodec",
    "DistributedTransport", "EntryMeta", "FileTransport", "HashMismatchError", "InProcessTransport",
    "OutOfOrderError", "Payload", "Projection", "ReplayError", "ResyncRequiredError", "ShapeMismatchError", "SyncError",
    "SyncRates", "SyncReceiver", "SyncSender", "SyncStats", "Transport", "TruncatedPayloadError", "UnknownCodecError",
    "VersionMismatchError", "WeightCodec", "apply_", "build_bucket", "empirical_entropy_bits", "encode",
    "get_codec", "parse_bucket", "position_entropy_bits", "project_sync", "rates_at", "state_fingerprint", "warmup",
]
