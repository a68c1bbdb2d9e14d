import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from torchtune.models.llama3_2 import llama3_2 as tt_llama3_2
from torchtune.models.qwen2 import qwen2 as tt_qwen2
from torchtune.modules import MultiHeadAttention

from sparrow.attention import AttentionBackend, DenseAttention, LayerShape
from sparrow.models import SparrowAttention, load_hf_checkpoint, qwen2_5_0_5b, tiny_qwen2, use_attention

TINY = dict(vocab_size=96, num_layers=3, num_heads=6, num_kv_heads=2, embed_dim=96, intermediate_dim=160,
            max_seq_len=512)


def _torchtune_model(family: str):
    torch.manual_seed(0)
    if family == "qwen2":
        m = tt_qwen2(**TINY, tie_word_embeddings=True)
    else:
        m = tt_llama3_2(**TINY)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m.eval()


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
@pytest.mark.parametrize("seq_len", [1, 37, 128], ids=lambda s: f"S{s}")
def test_dense_logits_equal_torchtune(family, seq_len):
    ref = _torchtune_model(family)
    ours = use_attention(copy.deepcopy(ref), DenseAttention)
    assert all(isinstance(layer.attn, SparrowAttention) for layer in ours.layers)
    assert set(ours.state_dict()) == set(ref.state_dict())
    tokens = torch.randint(0, TINY["vocab_size"], (2, seq_len))
    with torch.no_grad():
        diff = (ours(tokens) - ref(tokens)).abs().max().item()
    assert diff <= 1e-5


def test_training_gradients_flow():
    m = use_attention(_torchtune_model("qwen2"))
    tokens = torch.randint(0, TINY["vocab_size"], (2, 20))
    m(tokens).sum().backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_backend_swap_keeps_weights():
    m = tiny_qwen2()
    before = {k: v.clone() for k, v in m.state_dict().items()}

    class Marked(DenseAttention):
        pass

    use_attention(m, Marked)
    assert all(type(layer.attn.backend) is Marked for layer in m.layers)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_bad_factory_and_shapes():
    m = tiny_qwen2()
    with pytest.raises(TypeError, match="not an AttentionBackend"):
        use_attention(m, lambda shape: torch.nn.Identity())
    with pytest.raises(ValueError, match="divisible"):
        LayerShape(0, 6, 4, 16)
    attn = _torchtune_model("qwen2").layers[0].attn
    assert isinstance(attn, MultiHeadAttention)
    with pytest.raises(ValueError, match="does not match the layer"):
        SparrowAttention.from_torchtune(attn, DenseAttention(LayerShape(0, 4, 2, 16)))


def test_named_builder_shapes():
    with torch.device("meta"):
        m = qwen2_5_0_5b(max_seq_len=1024)
    assert sum(p.numel() for p in m.parameters()) == 494_032_768
    assert isinstance(m.layers[0].attn.backend, AttentionBackend)


def _write_hf_dir(tmp_path, model):
    """Save ``model`` in Hugging Face Qwen2 format (config.json as released checkpoints write it + safetensors)."""
    from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

    sd = qwen2_tune_to_hf({k: v for k, v in model.state_dict().items()}, num_heads=TINY["num_heads"],
                          num_kv_heads=TINY["num_kv_heads"], dim=TINY["embed_dim"], tie_word_embeddings=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "vocab_size": TINY["vocab_size"], "num_hidden_layers": TINY["num_layers"],
           "num_attention_heads": TINY["num_heads"], "num_key_value_heads": TINY["num_kv_heads"],
           "hidden_size": TINY["embed_dim"], "intermediate_size": TINY["intermediate_dim"],
           "max_position_embeddings": TINY["max_seq_len"], "rms_norm_eps": 1e-5, "rope_theta": 1e6,
           "rope_scaling": None, "use_sliding_window": False, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))


def test_hf_checkpoint_roundtrip(tmp_path):
    src = use_attention(_torchtune_model("qwen2"))
    _write_hf_dir(tmp_path, src)
    dst = copy.deepcopy(src)
    for p in dst.parameters():
        torch.nn.init.normal_(p, std=0.1)
    load_hf_checkpoint(dst, tmp_path)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    tokens = torch.randint(0, TINY["vocab_size"], (1, 16))
    with torch.no_grad():
        assert torch.equal(dst.eval()(tokens), src(tokens))


def test_hf_checkpoint_errors(tmp_path):
    m = tiny_qwen2(**TINY)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(m, tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(m, tmp_path)
    _write_hf_dir(tmp_path, use_attention(_torchtune_model("qwen2")))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_hf_checkpoint(m, tmp_path, checkpoint_files=["missing.safetensors"])
    small = tiny_qwen2(vocab_size=TINY["vocab_size"])  # other sizes: config.json says so
    with pytest.raises(ValueError, match="num_layers: checkpoint 3 vs model 2"):
        load_hf_checkpoint(small, tmp_path)
    # config.json fits but a tensor is missing: the tensor check still stands behind the config check
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.norm.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    fits = use_attention(_torchtune_model("qwen2"))
    with pytest.raises(ValueError, match=r"does not fit the model: missing \['norm.scale'\]"):
        load_hf_checkpoint(fits, tmp_path)
