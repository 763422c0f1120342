"""Configs: defaults, derived properties, and bad values rejected with the field and value named."""

from __future__ import annotations

import dataclasses
import math

import pytest

from attnlab import AttentionConfig, MLAConfig, ModelConfig


def test_attention_defaults_and_properties():
    cfg = AttentionConfig(d_model=512, n_heads=8)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.n_rep, cfg.variant) == (8, 64, 1, "mha")
    assert (cfg.bias, cfg.rope, cfg.rope_theta, cfg.dropout, cfg.backend) == (
        False,
        True,
        10000.0,
        0.0,
        "auto",
    )
    assert AttentionConfig(d_model=512, n_heads=8, n_kv_heads=2).variant == "gqa"
    assert AttentionConfig(d_model=512, n_heads=8, n_kv_heads=2).n_rep == 4
    assert AttentionConfig(d_model=512, n_heads=8, n_kv_heads=1).variant == "mqa"
    # A given head_dim is kept even when d_model / n_heads differs (and when d_model is not divisible).
    assert AttentionConfig(d_model=100, n_heads=3, head_dim=40).head_dim == 40
    assert AttentionConfig(d_model=512, n_heads=8, head_dim=128).head_dim == 128
    # rope=False lifts the even head_dim rule.
    assert AttentionConfig(d_model=15, n_heads=3, rope=False).head_dim == 5


def test_configs_are_frozen_and_replace_revalidates():
    cfg = AttentionConfig(d_model=64, n_heads=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_heads = 8
    assert cfg.replace(n_kv_heads=2).variant == "gqa"
    with pytest.raises(ValueError, match=r"n_kv_heads=3 must divide n_heads=4"):
        cfg.replace(n_kv_heads=3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_heads": 8, "n_kv_heads": 3}, ValueError, "AttentionConfig.n_kv_heads=3 must divide n_heads=8"),
        ({"n_heads": 4, "n_kv_heads": 8}, ValueError, "AttentionConfig.n_kv_heads=8 must divide n_heads=4"),
        (
            {"d_model": 100, "n_heads": 8},
            ValueError,
            "AttentionConfig.d_model=100 is not divisible by n_heads=8",
        ),
        ({"n_heads": 4, "head_dim": 7}, ValueError, "AttentionConfig.head_dim=7 must be even when rope=True"),
        ({"n_heads": 4, "backend": "flash"}, ValueError, "AttentionConfig.backend must be one of .*'flash'"),
        ({"n_heads": 0}, ValueError, "AttentionConfig.n_heads must be >= 1, got 0"),
        ({"n_heads": 4.0}, TypeError, r"AttentionConfig.n_heads must be an int, got 4.0 \(float\)"),
        ({"n_heads": True}, TypeError, r"AttentionConfig.n_heads must be an int, got True \(bool\)"),
        ({"n_heads": 4, "n_kv_heads": 0}, ValueError, "AttentionConfig.n_kv_heads must be >= 1, got 0"),
        ({"n_heads": 4, "dropout": 1.0}, ValueError, r"AttentionConfig.dropout must be in \[0, 1\), got 1.0"),
        (
            {"n_heads": 4, "dropout": -0.1},
            ValueError,
            r"AttentionConfig.dropout must be in \[0, 1\), got -0.1",
        ),
        (
            {"n_heads": 4, "rope_theta": 0.0},
            ValueError,
            "AttentionConfig.rope_theta must be a finite number > 0, got 0.0",
        ),
        (
            {"n_heads": 4, "rope_theta": "1e4"},
            TypeError,
            "AttentionConfig.rope_theta must be a number, got '1e4'",
        ),
        # accepted once, failing at the first forward with transformers' KeyError (or as plain RoPE)
        (
            {"n_heads": 4, "rope_scaling": (("rope_type", "llama3"), ("factor", 8.0))},
            ValueError,
            "rope_scaling: rope_type 'llama3' needs low_freq_factor, a number; got None",
        ),
        (
            {"n_heads": 4, "rope_scaling": (("rope_type", "ntk"), ("factor", 8.0))},
            ValueError,
            "rope_type 'ntk' is not one of default, linear",
        ),
        (
            {
                "n_heads": 4,
                "rope_scaling": (("rope_type", "longrope"), ("short_factor", 1.0), ("long_factor", (1.0,))),
            },
            ValueError,
            "needs short_factor, a tuple of numbers; got 1.0",
        ),
        (
            {"n_heads": 4, "norm_eps": float("nan")},
            ValueError,
            "AttentionConfig.norm_eps must be a finite number >= 0",
        ),
        (
            {"n_heads": 4, "norm_eps": -1e-6},
            ValueError,
            "AttentionConfig.norm_eps must be a finite number >= 0",
        ),
    ],
)
def test_attention_config_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        AttentionConfig(**({"d_model": 64} | kwargs))


MLA = dict(d_model=64, n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def test_mla_defaults_and_properties():
    cfg = MLAConfig(**MLA)
    assert (cfg.q_lora_rank, cfg.mode, cfg.backend, cfg.variant) == (0, "auto", "auto", "mla")
    assert cfg.qk_head_dim == 24
    assert cfg.softmax_scale == 24**-0.5
    assert cfg.cache_dim == 32 + 8
    assert MLAConfig(**(MLA | {"qk_nope_head_dim": 0})).qk_head_dim == 8  # rope-only keys are allowed


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"qk_rope_head_dim": 7}, ValueError, "MLAConfig.qk_rope_head_dim=7 must be even"),
        ({"mode": "fast"}, ValueError, "MLAConfig.mode must be one of auto, naive, absorbed; got 'fast'"),
        ({"backend": "xla"}, ValueError, "MLAConfig.backend must be one of .*'xla'"),
        ({"q_lora_rank": -1}, ValueError, "MLAConfig.q_lora_rank must be >= 0, got -1"),
        ({"kv_lora_rank": 0}, ValueError, "MLAConfig.kv_lora_rank must be >= 1, got 0"),
        ({"v_head_dim": 8.5}, TypeError, "MLAConfig.v_head_dim must be an int, got 8.5"),
        ({"dropout": 2}, ValueError, r"MLAConfig.dropout must be in \[0, 1\), got 2"),
        ({"rope_theta": -1.0}, ValueError, "MLAConfig.rope_theta must be a finite number > 0, got -1.0"),
        (
            {"rope_theta": float("nan")},
            ValueError,
            "MLAConfig.rope_theta must be a finite number > 0, got nan",
        ),
        (
            {"rope_theta": float("inf")},
            ValueError,
            "MLAConfig.rope_theta must be a finite number > 0, got inf",
        ),
    ],
)
def test_mla_config_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        MLAConfig(**(MLA | kwargs))


def test_model_config_validation():
    attn = AttentionConfig(d_model=64, n_heads=4)
    cfg = ModelConfig(vocab_size=100, n_layers=2, attention=attn, ffn_dim=128)
    assert (cfg.d_model, cfg.n_heads, cfg.is_moe) == (64, 4, False)
    with pytest.raises(
        TypeError, match=r"ModelConfig.attention must be an AttentionConfig or MLAConfig, got dict"
    ):
        ModelConfig(vocab_size=100, n_layers=2, attention={"d_model": 64}, ffn_dim=128)
    with pytest.raises(ValueError, match=r"ModelConfig.n_layers must be >= 1, got 0"):
        cfg.replace(n_layers=0)
    with pytest.raises(ValueError, match=r"ModelConfig.mlp must be one of .*'relu'"):
        cfg.replace(mlp="relu")
    with pytest.raises(ValueError, match=r"n_active_experts=9 must be in \[1, n_experts=8\]"):
        cfg.replace(n_experts=8, n_active_experts=9, moe_ffn_dim=32)
    with pytest.raises(ValueError, match=r"attention.d_model=32 does not match the model's d_model=64"):
        cfg.with_attention(AttentionConfig(d_model=32, n_heads=4))
    assert cfg.with_attention(MLAConfig(**MLA)).attention.variant == "mla"
    for field, value, rule in [("norm_eps", -1.0, ">= 0"), ("norm_eps", math.inf, ">= 0"),
                               ("embed_scale", math.nan, "> 0"), ("embed_scale", 0.0, "> 0")]:  # fmt: skip
        with pytest.raises(
            ValueError, match=f"ModelConfig.{field} must be a finite number {rule}, got {value}"
        ):
            cfg.replace(**{field: value})


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: AttentionConfig(d_model=64, n_heads=4, bias=1), "AttentionConfig.bias"),
        (lambda: AttentionConfig(d_model=64, n_heads=4, out_bias="no"), "AttentionConfig.out_bias"),
        (lambda: AttentionConfig(d_model=64, n_heads=4, rope=None), "AttentionConfig.rope"),
    ],
)
def test_flags_must_be_bool(make, field):
    with pytest.raises(TypeError, match=f"{field} must be True or False"):
        make()


@pytest.mark.parametrize("factor", [0, -2.0, float("inf")])
def test_a_rope_factor_that_is_not_positive_is_refused(factor):
    # a linear factor of 0 divided every frequency by zero: NaN logits, a null loss and exit 0
    from attnlab.config import rope_parameter_problem

    assert "needs factor > 0" in rope_parameter_problem("linear", {"factor": factor})
    assert "needs long_factor > 0" in rope_parameter_problem(
        "longrope", {"short_factor": (1.0, 2.0), "long_factor": (1.0, factor)}
    )
    assert (
        rope_parameter_problem("yarn", {"factor": 0.5}) is None
    )  # below 1 is odd, but transformers computes it
