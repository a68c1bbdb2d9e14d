"""Worker of the 3-process gloo test (run as a script: rank, world size, port, output folder).

Rank 0 trains a tiny model with AdamW and sends its bf16 weights with ``SyncSender`` through a
``DistributedTransport``; ranks 1 and 2 receive. After every sync rank 0 broadcasts its bf16 bits densely
(test-only) and each receiver records whether it matches bit for bit. After 30 clean steps rank 2 flips
one bit of its copy: the next sync must fail its hash check there, be undone, and the one after must be
a dense anchor that brings rank 2 back.

Then three more steps go through a user codec (``_user_codec.XorDeltaCodec``) over the same transport:
rank 1 has it, rank 2 does not and refuses every delta (asking for a resync, which makes the next sync a
dense anchor that rank 2 can apply).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from _user_codec import XorDeltaCodec  # this script's folder is on sys.path

from sparrow.sync import DistributedTransport, HashMismatchError, SyncError, SyncReceiver, SyncSender

STEPS = 33
DIVERGE_STEP = 30
USER_STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))


def _flat_bits(named: dict) -> torch.Tensor:
    # gloo has no int16 collectives: widen the bit patterns (exactly) to int32
    return torch.cat([t.detach().to(torch.bfloat16).reshape(-1).view(torch.int16) for t in named.values()]).to(torch.int32)


def main(rank: int, world: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    model = _model()
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    transport = DistributedTransport(src=0)
    res: dict = {"rank": rank, "equal": [], "errors": [], "anchors": [], "bytes": [], "dense": []}
    if rank == 0:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        sender = SyncSender(bf16, bucket_bytes=2048, anchor_every=10, run_id="gloo-test")
        gen = torch.Generator().manual_seed(1)
    else:
        receiver = SyncReceiver({n: t.clone() for n, t in bf16.items()})
    n_total = sum(t.numel() for t in bf16.values())
    for step in range(STEPS):
        if rank == 0:
            x = torch.randn(64, 32, generator=gen)
            loss = (model(x) - x[:, :16]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats = sender.send(dict(model.named_parameters()), transport)
            res["anchors"].append(stats.anchor)
            res["bytes"].append(stats.wire_bytes)
            res["dense"].append(stats.dense_bytes)
            ref = _flat_bits(dict(model.named_parameters()))
        else:
            if rank == 2 and step == DIVERGE_STEP:
                first = next(iter(receiver.tensors.values()))
                first.detach().view(-1).view(torch.int16)[3] ^= 1
            try:
                receiver.receive(transport)
            except HashMismatchError as exc:
                res["errors"].append([step, type(exc).__name__])
            ref = torch.empty(n_total, dtype=torch.int32)
        dist.broadcast(ref, 0)
        if rank != 0:
            res["equal"].append(bool(torch.equal(_flat_bits(receiver.tensors), ref)))
            res["version"] = receiver.version
    res.update(user_equal=[], user_errors=[], user_anchors=[])
    if rank == 0:
        usender = SyncSender({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()},
                             codec=XorDeltaCodec(), bucket_bytes=2048, run_id="gloo-user")
    else:
        urx = SyncReceiver(receiver.tensors, codecs=[XorDeltaCodec()] if rank == 1 else [])
    for step in range(USER_STEPS):
        if rank == 0:
            x = torch.randn(64, 32, generator=gen)
            loss = (model(x) - x[:, :16]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            res["user_anchors"].append(usender.send(dict(model.named_parameters()), transport).anchor)
            ref = _flat_bits(dict(model.named_parameters()))
        else:
            try:
                urx.receive(transport)
            except SyncError as exc:
                res["user_errors"].append([step, type(exc).__name__])
            ref = torch.empty(n_total, dtype=torch.int32)
        dist.broadcast(ref, 0)
        if rank != 0:
            res["user_equal"].append(bool(torch.equal(_flat_bits(urx.tensors), ref)))
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    # no destroy_process_group: rank 0 hosts the TCP store, and tearing the group down while another rank is
    # still leaving it aborted rank 0 now and then ("terminate called without an active exception"). Every
    # rank has written its result and passed the barrier: leave without running destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
