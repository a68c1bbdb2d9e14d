import torch

from sparrow.sync import state_fingerprint


def test_fingerprint_follows_bits_names_and_shapes_not_order():
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(17, 5, generator=g).to(torch.bfloat16), "b": torch.randn(9, generator=g)}
    fp = state_fingerprint(a)
    assert fp == state_fingerprint(dict(reversed(list(a.items()))))  # the dict's order does not matter
    flipped = {k: v.clone() for k, v in a.items()}
    flipped["w"].view(torch.int16).view(-1)[3] ^= 1  # one mantissa bit
    assert state_fingerprint(flipped) != fp
    signed = {k: v.clone() for k, v in a.items()}
    signed["b"][0] = 0.0
    negzero = {k: v.clone() for k, v in a.items()}
    negzero["b"][0] = -0.0
    assert state_fingerprint(signed) != state_fingerprint(negzero)  # +0.0 and -0.0 differ in bits
    assert state_fingerprint({"v": a["w"], "b": a["b"]}) != fp  # bound to the names
    assert state_fingerprint({"w": a["w"].view(5, 17), "b": a["b"]}) != fp  # and to the shapes
    assert -(1 << 63) <= fp < (1 << 63)
