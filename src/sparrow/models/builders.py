"""Model builders: torchtune's component builders with Sparrow attention swapped in.

Two levels, as in torchtune: ``qwen2`` / ``llama3`` take every architectural argument; the named
builders (``qwen2_5_0_5b``, ``llama3_2_1b``, ``tiny_qwen2`` ...) fix the sizes. Every builder takes
``attention`` (a callable ``LayerShape -> AttentionBackend``; default :class:`DenseAttention`) and
``max_seq_len`` (the RoPE table length, i.e. the longest context the model can be run at).
"""

from __future__ import annotations

from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.llama3_2 import llama3_2 as _tt_llama3_2
from torchtune.models.qwen2 import qwen2 as _tt_qwen2
from torchtune.modules import RotaryPositionalEmbeddings, TransformerDecoder

from sparrow.attention.dense import DenseAttention
from sparrow.models.attention import AttentionFactory, use_attention


def qwen2(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
    attention: AttentionFactory = DenseAttention,
) -> TransformerDecoder:
    """Qwen2 / Qwen2.5 decoder (torchtune's ``qwen2``) with Sparrow attention."""
    model = _tt_qwen2(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        embed_dim=embed_dim, intermediate_dim=intermediate_dim, max_seq_len=max_seq_len, norm_eps=norm_eps,
        rope_base=rope_base, tie_word_embeddings=tie_word_embeddings,
    )
    return use_attention(model, attention)


def llama3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    norm_eps: float = 1e-5,
    rope_base: float = 500_000,
    scale_factor: float | None = 32,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    old_context_len: int = 8192,
    tie_word_embeddings: bool = True,
    attention: AttentionFactory = DenseAttention,
) -> TransformerDecoder:
    """Llama-3.x decoder (torchtune's ``llama3_2`` component builder) with Sparrow attention.

    RoPE: ``scale_factor=None`` gives plain RoPE (Llama-3.0 checkpoints, no ``rope_scaling``); a number gives
    Llama-3.1-style scaled RoPE (torchtune's ``Llama3ScaledRoPE``, Hugging Face ``rope_type: llama3``) with
    ``factor=scale_factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings=old_context_len``. The defaults are Llama-3.2's (32, 1, 4, 8192);
    Llama-3.1 uses factor 8.

    Raises:
        ValueError: a non-positive ``scale_factor`` / ``old_context_len``, or not
            ``0 < low_freq_factor < high_freq_factor``.
    """
    head_dim = embed_dim // num_heads
    if scale_factor is None:
        rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    else:
        if not scale_factor > 0 or not old_context_len > 0:
            raise ValueError(f"llama3: scale_factor and old_context_len must be > 0, got scale_factor={scale_factor}, "
                             f"old_context_len={old_context_len}")
        if not 0 < low_freq_factor < high_freq_factor:
            raise ValueError(f"llama3: need 0 < low_freq_factor < high_freq_factor, got low_freq_factor="
                             f"{low_freq_factor}, high_freq_factor={high_freq_factor}")
        rope = Llama3ScaledRoPE(dim=head_dim, max_seq_len=max_seq_len, base=rope_base, scale_factor=scale_factor,
                                low_freq_factor=low_freq_factor, high_freq_factor=high_freq_factor,
                                old_context_len=old_context_len)
    model = _tt_llama3_2(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        embed_dim=embed_dim, max_seq_len=max_seq_len, intermediate_dim=intermediate_dim, norm_eps=norm_eps,
        rope_base=rope_base, scale_factor=scale_factor or 1, tie_word_embeddings=tie_word_embeddings,
    )
    for layer in model.layers:  # torchtune's builder shares one RoPE module across layers: so does this one
        layer.attn.pos_embeddings = rope
    return use_attention(model, attention)


# -- named sizes --------------------------------------------------------------------------------------

def qwen2_5_0_5b(*, max_seq_len: int = 32768, attention: AttentionFactory = DenseAttention) -> TransformerDecoder:
    """Qwen2.5-0.5B (base or instruct): 24 layers, 14 q / 2 kv heads, head_dim 64, tied embeddings."""
    return qwen2(vocab_size=151936, num_layers=24, num_heads=14, num_kv_heads=2, embed_dim=896,
                 intermediate_dim=4864, max_seq_len=max_seq_len, tie_word_embeddings=True, attention=attention)


def qwen2_5_1_5b(*, max_seq_len: int = 32768, attention: AttentionFactory = DenseAttention) -> TransformerDecoder:
    """Qwen2.5-1.5B (base or instruct): 28 layers, 12 q / 2 kv heads, head_dim 128, tied embeddings."""
    return qwen2(vocab_size=151936, num_layers=28, num_heads=12, num_kv_heads=2, embed_dim=1536,
                 intermediate_dim=8960, max_seq_len=max_seq_len, tie_word_embeddings=True, attention=attention)


def qwen2_5_7b(*, max_seq_len: int = 32768, attention: AttentionFactory = DenseAttention) -> TransformerDecoder:
    """Qwen2.5-7B: 28 layers, 28 q / 4 kv heads, head_dim 128, untied embeddings."""
    return qwen2(vocab_size=152064, num_layers=28, num_heads=28, num_kv_heads=4, embed_dim=3584,
                 intermediate_dim=18944, max_seq_len=max_seq_len, tie_word_embeddings=False, attention=attention)


def llama3_2_1b(*, max_seq_len: int = 131072, attention: AttentionFactory = DenseAttention) -> TransformerDecoder:
    """Llama-3.2-1B: 16 layers, 32 q / 8 kv heads, head_dim 64, tied embeddings."""
    return llama3(vocab_size=128_256, num_layers=16, num_heads=32, num_kv_heads=8, embed_dim=2048,
                  intermediate_dim=8192, max_seq_len=max_seq_len, attention=attention)


def llama3_2_3b(*, max_seq_len: int = 131072, attention: AttentionFactory = DenseAttention) -> TransformerDecoder:
    """Llama-3.2-3B: 28 layers, 24 q / 8 kv heads, head_dim 128, tied embeddings."""
    return llama3(vocab_size=128_256, num_layers=28, num_heads=24, num_kv_heads=8, embed_dim=3072,
                  intermediate_dim=8192, max_seq_len=max_seq_len, attention=attention)


def tiny_qwen2(
    *,
    vocab_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    embed_dim: int = 64,
    intermediate_dim: int = 128,
    max_seq_len: int = 1024,
    tie_word_embeddings: bool = True,
    attention: AttentionFactory = DenseAttention,
) -> TransformerDecoder:
    """A small Qwen2-architecture model for tests, demos and the CPU recipe (head_dim 16 by default)."""
    return qwen2(vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 embed_dim=embed_dim, intermediate_dim=intermediate_dim, max_seq_len=max_seq_len,
                 tie_word_embeddings=tie_word_embeddings, attention=attention)


def tiny_llama3(
    *,
    vocab_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    embed_dim: int = 64,
    intermediate_dim: int = 128,
    max_seq_len: int = 1024,
    attention: AttentionFactory = DenseAttention,
) -> TransformerDecoder:
    """A small Llama-3-architecture model for tests (head_dim 16 by default)."""
    return llama3(vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  embed_dim=embed_dim, intermediate_dim=intermediate_dim, max_seq_len=max_seq_len,
                  attention=attention)
