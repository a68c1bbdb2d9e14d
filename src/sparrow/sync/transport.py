"""Transports move buckets from one :class:`~sparrow.sync.SyncSender` to its receivers.

* :class:`InProcessTransport`: queues in one process (tests, colocated trainer / rollout).
* :class:`DistributedTransport`: ``torch.distributed`` broadcast from one source rank to every rank of a
  group (gloo on CPU tensors, NCCL on CUDA tensors); every rank of the group must take part.
* :class:`FileTransport`: a shared directory (trainer and rollout share only storage): one safetensors
  file per bucket, written to a temporary name and atomically renamed, plus a commit marker per sync.

A transport is used by the sender through ``send_bucket`` / ``end_sync_sender`` and by a receiver through
``recv_bucket`` / ``end_sync_receiver``; the end-of-sync calls carry the receivers' dense-resync requests
back to the sender.
"""

from __future__ import annotations

import abc
import json
import os
import shutil
import time
from collections import deque
from pathlib import Path

import torch

from .bucket import BucketInfo


class Transport(abc.ABC):
    """Bucket channel between one sender and its receivers."""

    @abc.abstractmethod
    def send_bucket(self, bucket: torch.Tensor, info: BucketInfo) -> None:
        """Deliver one bucket (1-D uint8 tensor) to every receiver."""

    @abc.abstractmethod
    def recv_bucket(self) -> tuple[torch.Tensor, bool]:
        """Next bucket for this receiver and whether it is the last bucket of its sync."""

    def end_sync_sender(self) -> bool:
        """Called by the sender after the last bucket; True when a receiver asked for a dense resync."""
        return False

    def poll_resync(self) -> bool:
        """Called by the sender before a sync (non-collective transports): a resync request that
        arrived since the last sync ended. Default: none."""
        return False

    def end_sync_receiver(self, resync: bool) -> None:
        """Called by a receiver after the last bucket of a sync with its resync request."""


class InProcessTransport(Transport):
    """Per-receiver FIFO queues in one process. ``transport.endpoint(i)`` is receiver ``i``'s view;
    the transport itself acts as receiver 0. ``device`` moves buckets on delivery (default: keep)."""

    def __init__(self, num_receivers: int = 1, device: torch.device | str | None = None) -> None:
        if num_receivers < 1:
            raise ValueError("num_receivers must be >= 1")
        self.device = device
        self._queues: list[deque] = [deque() for _ in range(num_receivers)]
        self._resync = [False] * num_receivers
        self._index = 0

    def endpoint(self, i: int) -> "InProcessTransport":
        ep = object.__new__(InProcessTransport)
        ep.__dict__.update(self.__dict__)
        ep._index = i
        return ep

    def send_bucket(self, bucket: torch.Tensor, info: BucketInfo) -> None:
        b = bucket.to(self.device) if self.device is not None else bucket
        for q in self._queues:
            q.append((b, info.last))

    def recv_bucket(self) -> tuple[torch.Tensor, bool]:
        q = self._queues[self._index]
        if not q:
            raise RuntimeError(f"no bucket pending for in-process receiver {self._index}")
        return q.popleft()

    def pending(self) -> int:
        return len(self._queues[self._index])

    def end_sync_sender(self) -> bool:
        req = any(self._resync)
        for k in range(len(self._resync)):
            self._resync[k] = False
        return req

    poll_resync = end_sync_sender

    def end_sync_receiver(self, resync: bool) -> None:
        self._resync[self._index] = self._resync[self._index] or resync


class DistributedTransport(Transport):
    """Broadcast from rank ``src`` to all ranks of ``group`` (two collectives per bucket: its length and
    ``last`` flag, then the bytes; one all-reduce per sync for resync requests).

    ``device``: where buckets travel; default ``cuda:<current device>`` for NCCL, CPU otherwise. Every rank
    of the group must call the matching methods in the same order (the sender ``send``, every other rank
    ``receive``), so a receiver that fails keeps draining the sync's buckets before raising.
    """

    def __init__(self, src: int = 0, group=None, device: torch.device | str | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedTransport needs an initialised torch.distributed process group")
        self.dist = dist
        self.src = src
        self.group = group
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)

    def send_bucket(self, bucket: torch.Tensor, info: BucketInfo) -> None:
        head = torch.tensor([bucket.numel(), int(info.last)], dtype=torch.int64, device=self.device)
        self.dist.broadcast(head, self.src, group=self.group)
        self.dist.broadcast(bucket.to(self.device).contiguous(), self.src, group=self.group)

    def recv_bucket(self) -> tuple[torch.Tensor, bool]:
        head = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.dist.broadcast(head, self.src, group=self.group)
        size, last = head.tolist()
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.dist.broadcast(buf, self.src, group=self.group)
        return buf, bool(last)

    def _flag(self, value: bool) -> bool:
        flag = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def end_sync_sender(self) -> bool:
        return self._flag(False)

    def end_sync_receiver(self, resync: bool) -> None:
        self._flag(resync)


class FileTransport(Transport):
    """Buckets as files in a shared ``directory``.

    Sender: ``sync_<target>/bucket_<i>.safetensors`` (one uint8 tensor ``"bucket"``), each written to a
    ``.tmp`` name then ``os.replace``-d; after the last bucket the commit marker ``sync_<target>.json`` is
    written the same way. Only the newest ``keep`` syncs are kept. Receiver: waits (``timeout_s``) for the
    next committed sync after the last one it read and reads its buckets in order; its resync request is
    the file ``resync_request``, consumed by the sender at the end of its next sync.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 4, timeout_s: float = 600.0,
                 poll_s: float = 0.05, device: torch.device | str = "cpu") -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.device = device
        self._seen = -1  # receiver: last target read
        self._cur: tuple[int, int, int] | None = None  # receiver: (target, nbuckets, next index)

    @staticmethod
    def _atomic_write(path: Path, write) -> None:
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write(tmp)
        os.replace(tmp, path)

    def _sync_dir(self, target: int) -> Path:
        return self.dir / f"sync_{target:010d}"

    def send_bucket(self, bucket: torch.Tensor, info: BucketInfo) -> None:
        from safetensors.torch import save_file

        d = self._sync_dir(info.target_version)
        d.mkdir(exist_ok=True)
        data = {"bucket": bucket.detach().to("cpu").contiguous()}
        meta = {"format": "sparrow-sync-bucket", "run_id": info.run_id, "index": str(info.index)}
        self._atomic_write(d / f"bucket_{info.index:05d}.safetensors", lambda p: save_file(data, str(p), meta))
        if info.last:
            commit = {"run_id": info.run_id, "base_version": info.base_version,
                      "target_version": info.target_version, "anchor": info.anchor, "buckets": info.index + 1}
            self._atomic_write(self.dir / f"sync_{info.target_version:010d}.json",
                               lambda p: p.write_text(json.dumps(commit)))
            self._prune()

    def _committed(self) -> list[int]:
        out = []
        for p in self.dir.glob("sync_*.json"):
            try:
                out.append(int(p.stem.split("_")[1]))
            except (IndexError, ValueError):
                continue
        return sorted(out)

    def _prune(self) -> None:
        for t in self._committed()[: -self.keep]:
            (self.dir / f"sync_{t:010d}.json").unlink(missing_ok=True)
            shutil.rmtree(self._sync_dir(t), ignore_errors=True)

    def recv_bucket(self) -> tuple[torch.Tensor, bool]:
        from safetensors.torch import load_file

        if self._cur is None:
            deadline = time.monotonic() + self.timeout_s
            while True:
                later = [t for t in self._committed() if t > self._seen]
                if later:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no committed sync after version {self._seen} in {self.dir} "
                                       f"within {self.timeout_s:.0f} s")
                time.sleep(self.poll_s)
            target = later[0]
            commit = json.loads((self.dir / f"sync_{target:010d}.json").read_text())
            self._cur = (target, int(commit["buckets"]), 0)
        target, nb, i = self._cur
        path = self._sync_dir(target) / f"bucket_{i:05d}.safetensors"
        bucket = load_file(str(path), device=str(self.device))["bucket"]
        last = i + 1 >= nb
        self._cur = None if last else (target, nb, i + 1)
        if last:
            self._seen = target
        return bucket, last

    def end_sync_sender(self) -> bool:
        p = self.dir / "resync_request"
        if p.exists():
            p.unlink(missing_ok=True)
            return True
        return False

    poll_resync = end_sync_sender

    def end_sync_receiver(self, resync: bool) -> None:
        if resync:
            self._atomic_write(self.dir / "resync_request", lambda p: p.write_text("1"))
