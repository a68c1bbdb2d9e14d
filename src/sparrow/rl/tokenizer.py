"""A character-level tokenizer for the synthetic tasks (no files, no network), and what the recipe asks of any
tokenizer: how many ids it can emit and which ids stop a response."""

from __future__ import annotations

from typing import Any, Sequence

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz =;:?,.\n"


class CharTokenizer:
    """Maps the characters of the synthetic tasks to ids; ``vocab_size`` is padded to a multiple of 8.

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then :data:`CHARS`. Encoding is exact for
    text made of those characters (upper case is folded to lower case); anything else raises ValueError.
    """

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self) -> None:
        self._to_id = {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
        self._to_char = {i: c for c, i in self._to_id.items()}
        lut = bytearray([255]) * 256  # byte -> id (255: not in the alphabet), for bytes.translate
        for c, i in self._to_id.items():
            lut[ord(c)] = i
        self._lut = bytes(lut)
        n = len(SPECIALS) + len(CHARS)
        self.vocab_size = (n + 7) // 8 * 8

    @property
    def stop_tokens(self) -> list[int]:
        return [self.eos_id]

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        low = text.lower()
        try:  # one C-level pass: an 8K-character prompt in microseconds, not a Python loop per character
            mapped = low.encode("ascii").translate(self._lut)
        except UnicodeEncodeError:
            mapped = b"\xff"
        if 255 in mapped:
            bad = next(ch for ch in low if ch not in self._to_id)
            raise ValueError(f"character {bad!r} is not in the synthetic tokenizer's alphabet")
        return ([self.bos_id] if add_bos else []) + list(mapped) + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in self._to_char:
                out.append(self._to_char[i])
            elif not skip_special:
                out.append(SPECIALS[i] if i < len(SPECIALS) else "<unk>")
        return "".join(out)


def emittable_ids(tokenizer: Any) -> int:
    """How many ids ``tokenizer`` can turn into text: ids ``0 .. n-1`` all decode, ids ``>= n`` have no token.

    Read from ``vocab_size`` when the tokenizer has one (the synthetic tokenizer, torchtune's tiktoken-based
    Llama-3 tokenizer), else from the vocabulary and special tokens of a BPE tokenizer (torchtune's Qwen2 /
    Qwen2.5: ordinary tokens 0..151,642, special tokens 151,643..151,664, so 151,665 of the checkpoint's
    151,936 embedding rows).

    Raises:
        ValueError: the ids have holes (an id below the largest has no token), or the tokenizer offers neither.
    """
    n = getattr(tokenizer, "vocab_size", None)
    if isinstance(n, int) and n > 0:
        return n
    vocab = getattr(tokenizer, "encoder", None)
    if isinstance(vocab, dict) and vocab:
        ids = set(vocab.values()) | set((getattr(tokenizer, "special_tokens", None) or {}).values())
        n = max(ids) + 1
        if len(ids) != n or min(ids) != 0:
            missing = sorted(set(range(n)) - ids)[:5]
            raise ValueError(f"{type(tokenizer).__name__}'s ids are not contiguous: ids {missing}... below {n} "
                             "have no token")
        return n
    raise ValueError(f"cannot tell which ids {type(tokenizer).__name__} can decode: it has neither a vocab_size "
                     "nor an encoder dict")


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's ``stop_tokens`` (torchtune's Qwen: ``<|im_end|>`` and
    ``<|endoftext|>``), else its ``eos_id``."""
    ids = getattr(tokenizer, "stop_tokens", None) or [tokenizer.eos_id]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))
