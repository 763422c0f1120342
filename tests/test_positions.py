"""Explicit positions: a left-padded batch against transformers' LlamaForCausalLM (same weights, attention_mask and
position_ids, prefill and cached decode), packed sequences against each sequence alone, RoPE angles computed
once per forward, and bad position_ids."""

from __future__ import annotations

import pytest
import torch
import transformers

import attnlab.attention.rope as rope
from attnlab import AttentionConfig, MLAConfig, ModelConfig
from attnlab.hf.llama import model_config_from_hf, state_from_hf
from attnlab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")
PADS = (0, 3, 5)  # left padding of each row
T = 9


def _pair(impl: str) -> tuple[transformers.LlamaForCausalLM, Transformer]:
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=impl,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = model_config_from_hf(hf_cfg.to_dict())
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state_from_hf(hf.state_dict(), cfg))
    return hf, ours


def _left_padded() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens (B, T), attention_mask (B, T) of 1 = token, 0 = left padding, and HF's position_ids for it."""
    tokens = torch.randint(0, 96, (len(PADS), T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(len(PADS), T, dtype=torch.long)
    for row, pad in enumerate(PADS):
        mask[row, :pad] = 0
        tokens[row, :pad] = 0  # a pad token id: any value, it is masked
    return tokens, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _keys(mask: torch.Tensor) -> torch.Tensor:
    """The (B, T) padding mask as attnlab's attn_mask over keys: (B, 1, 1, T) bool, True = attend."""
    return mask.bool()[:, None, None, :]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_left_padded_batch_equals_transformers_prefill_and_decode(impl):
    hf, ours = _pair(impl)
    tokens, mask, position_ids = _left_padded()
    real = mask.bool()
    with torch.no_grad():
        expected = hf(tokens, attention_mask=mask, position_ids=position_ids, use_cache=True)
        caches = ours.new_caches(len(PADS), T + 2)
        got = ours(tokens, caches=caches, attn_mask=_keys(mask), position_ids=position_ids)
        assert (got[real] - expected.logits[real]).abs().max() <= 1e-5
        # RoPE sees relative positions only, so a shift per row changes nothing; a gap does, in both models alike.
        gapped = position_ids + 7 * (torch.arange(T) >= 6)
        hf_gapped = hf(tokens, attention_mask=mask, position_ids=gapped).logits
        ours_gapped = ours(tokens, attn_mask=_keys(mask), position_ids=gapped)
        assert (ours_gapped[real] - hf_gapped[real]).abs().max() <= 1e-5
        assert (ours_gapped[real] - got[real]).abs().max() > 1e-3
        # Each row alone, unpadded, is the same sequence: padding changes nothing where there are tokens.
        for row, pad in enumerate(PADS):
            alone = ours(tokens[row : row + 1, pad:])
            assert (got[row, pad:] - alone[0]).abs().max() <= 1e-5
        # Two decode steps through the caches, the padding still masked, positions continuing per row.
        past = expected.past_key_values
        for _ in range(2):
            nxt = got[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat((mask, torch.ones_like(nxt)), dim=1)
            position_ids = position_ids[:, -1:] + 1
            expected = hf(
                nxt, attention_mask=mask, position_ids=position_ids, past_key_values=past, use_cache=True
            )
            past = expected.past_key_values
            got = ours(nxt, caches=caches, attn_mask=_keys(mask), position_ids=position_ids)
            assert (got - expected.logits).abs().max() <= 1e-5
    assert len(caches[0]) == T + 2


ATTENTION = {
    "gqa": AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2),
    "mla": MLAConfig(
        d_model=32, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    ),
}


def _model(name: str) -> Transformer:
    cfg = ModelConfig(vocab_size=97, n_layers=3, attention=ATTENTION[name], ffn_dim=64, max_seq_len=64)
    model = Transformer(cfg).eval()
    model.init_weights(std=0.3, seed=0)
    return model


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_packed_sequences_equal_each_sequence_alone(name):
    model = _model(name)
    lengths = (4, 3, 5)
    docs = [torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed = torch.cat(docs, dim=1)  # (1, 12): three documents in one training row
    doc_id = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    position_ids = torch.cat([torch.arange(n) for n in lengths])  # restarting at 0 per document
    same_doc = (doc_id[:, None] == doc_id[None, :])[
        None, None
    ]  # (1, 1, T, T); the model adds the causal rule
    with torch.no_grad():
        got = model(packed, attn_mask=same_doc, position_ids=position_ids)
        alone = torch.cat([model(d) for d in docs], dim=1)
        torch.testing.assert_close(got, alone, atol=1e-4, rtol=1e-5)  # logits up to ~10: float32 rounding


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_rope_angles_are_computed_once_per_forward(name, monkeypatch):
    model = _model(name)
    calls = []
    real = rope.rope_cos_sin
    monkeypatch.setattr(rope, "rope_cos_sin", lambda *a, **k: calls.append(a[1:]) or real(*a, **k))
    tokens = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        full = model(tokens)
        assert len(calls) == 1  # three layers, one computation
        caches = model.new_caches(2, 6)
        steps = [model(tokens[:, :4], caches=caches)] + [
            model(tokens[:, i : i + 1], caches=caches) for i in (4, 5)
        ]
        assert len(calls) == 4
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


def test_bad_position_ids_are_named():
    model = _model("gqa")
    tokens = torch.randint(0, 97, (2, 5))
    with pytest.raises(
        ValueError, match=r"position_ids must be \(T,\) or \(B, T\) = \(2, 5\), got shape \(2, 4\)"
    ):
        model(tokens, position_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"position_ids must be an integer tensor, got torch\.float32"):
        model(tokens, position_ids=torch.zeros(5))
    attn = model.layers[0].attention
    with pytest.raises(ValueError, match=r"position_ids must be \(T,\) or \(B, T\)"):
        attn(torch.randn(2, 5, 32), position_ids=torch.arange(6))
    # (T,) and (1, T) are broadcast over the batch: the default positions, given explicitly, change nothing.
    with torch.no_grad():
        plain = model(tokens)
        assert torch.equal(model(tokens, position_ids=torch.arange(5)), plain)
        assert torch.equal(model(tokens, position_ids=torch.arange(5)[None]), plain)
