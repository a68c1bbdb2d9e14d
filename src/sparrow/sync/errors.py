"""Errors raised by SparseRL-Sync. All are ``ValueError`` subclasses with messages naming the problem.

Every error raised while decoding or applying a payload / bucket is raised *before* any weight is
written, or after the written elements have been restored bit for bit (hash mismatch), so the
receiver's tensors are unchanged whenever one of these escapes from ``apply_`` or ``apply_bucket``.
"""

from __future__ import annotations

from ..kernels.sync.common import SyncFormatError


class SyncError(ValueError):
    """Base class of every sync error."""


class CorruptPayloadError(SyncError, SyncFormatError):
    """Bad magic, checksum mismatch, malformed manifest / body, or indices out of range."""


class TruncatedPayloadError(CorruptPayloadError):
    """The bytes end before the lengths in the header say they should (or carry trailing bytes)."""


class ShapeMismatchError(SyncError):
    """A payload entry does not match the target tensor (name, dtype, shape or element range)."""


class VersionMismatchError(SyncError):
    """The payload's base version is not the receiver's current version (or the run id differs)."""


class ReplayError(VersionMismatchError):
    """The payload targets a version the receiver already has (a replayed or duplicated sync)."""


class OutOfOrderError(SyncError):
    """A bucket arrived out of order (wrong index, or a new sync started before the last one ended)."""


class HashMismatchError(SyncError):
    """After applying, the target tensor's bits do not hash to the sender's hash; the write was undone."""


class ResyncRequiredError(SyncError):
    """The receiver refuses delta payloads until it gets a dense anchor (after an earlier failure)."""


class UnknownCodecError(SyncError):
    """A bucket entry names a user codec (:class:`~sparrow.sync.WeightCodec`) that the receiver was not given
    (``SyncReceiver(..., codecs=[...])``); the bucket is refused before anything is written."""
