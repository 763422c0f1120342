"""The Phi-3 family (``attnlab.families.phi3``): Phi-3-mini-4k (sliding window on every layer), Phi-3-128k / Phi-3.5
(longrope, switching to its long factors past ``original_max_position_embeddings``), Phi-4-mini (rotary on 3/4 of
each head, GQA, longrope, tied embeddings), against transformers' ``Phi3ForCausalLM`` with the same random weights;
the fused ``qkv_proj`` / ``gate_up_proj`` transforms; conversions; the config fields refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from family_oracle import (
    build,
    check_convert,
    check_convert_mla,
    check_generate,
    check_left_padded,
    check_logits,
    deepseek_without_latent_norm,
    tokens,
)
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.convert import convert_model_to_mla
from attnlab.convert.mla import full_rank
from attnlab.cost import kv_cache_bytes
from attnlab.families import FAMILIES
from attnlab.families.base import Fields
from attnlab.families.phi3 import TENSORS, read, write
from attnlab.hf import io, load_causal_lm
from attnlab.hf_config import from_hf_config

pytestmark = pytest.mark.usefixtures("one_thread")

# Phi3Config's token ids (32000) lie outside a test vocabulary; transformers warns about them.
SMALL = dict(
    hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
SWITCH = 16  # original_max_position_embeddings: prompts of 11 + 8 new tokens, and of 18 and 24, cross it


def longrope(pairs: int) -> dict:
    """Phi-3-128k-like RoPE parameters: distinct short and long factors for ``pairs`` rotary pairs."""
    return dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.25 * i for i in range(pairs)],
        long_factor=[2.0 + 3.0 * i for i in range(pairs)],
        rope_theta=10000.0,
    )


CASES = {
    "phi-3-mini-4k (window 8)": dict(SMALL, sliding_window=8, max_position_embeddings=64),
    "phi-3-128k (longrope)": dict(
        SMALL,
        rope_parameters=longrope(8),  # head_dim 16, every dim turns
        original_max_position_embeddings=SWITCH,
        max_position_embeddings=64,
        sliding_window=256,  # as the real ones: a window past every position, which changes nothing
    ),
    "phi-4-mini (partial rotary 0.75, GQA)": dict(
        SMALL,
        num_key_value_heads=2,
        partial_rotary_factor=0.75,  # 12 of 16 dims turn: 6 pairs
        rope_parameters=longrope(6),
        original_max_position_embeddings=SWITCH,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    return build(transformers.Phi3Config, tmp_path_factory.mktemp("phi3") / "src", **CASES[request.param])


def test_the_config_reads_as_transformers_builds_it(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    cfg = from_hf_config(checkpoint)
    attn, rotary = cfg.attention, hf.model.rotary_emb
    assert type(hf).__name__ == "Phi3ForCausalLM"
    assert attn.rotary_dim == 2 * rotary.inv_freq.numel()  # partial rotary: the dims transformers turns
    assert (
        attn.n_kv_heads == hf.config.num_key_value_heads
        and cfg.tie_embeddings == hf.config.tie_word_embeddings
    )
    window = hf.config.sliding_window  # transformers slides every layer when it is set
    assert [a.window for a in cfg.layer_attentions] == [window] * cfg.n_layers
    if attn.rope_scaling:  # the switch transformers uses is the one attnlab reads
        params = dict(attn.rope_scaling)
        assert (
            params["original_max_position_embeddings"]
            == hf.config.rope_parameters["original_max_position_embeddings"]
        )


def test_logits_equal_transformers_on_both_sides_of_the_switch_and_past_the_window(checkpoint):
    check_logits(checkpoint, n=12)  # longrope: short factors (12 <= 16); past the window of 8
    check_logits(checkpoint, n=24)  # longrope: long factors; three windows of 8


def test_bfloat16_logits_within_its_rounding(checkpoint):
    model = load_causal_lm(checkpoint).to(torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    x = tokens(20)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits.float(), rtol=0.05, atol=0.05)


def test_greedy_tokens_equal_transformers_through_both_caches(checkpoint):
    # 11 + 8 tokens: past the window of 8 in the ring, and across the switch at 16 (transformers drops its cache
    # there, attnlab prefills again); 18: a prompt already past it, in a paged batch beside shorter rows
    check_generate(checkpoint, lengths=(5, 11, 18), new=8)


def test_a_left_padded_batch_equals_its_rows_alone(checkpoint):
    check_left_padded(checkpoint, lengths=(3, 20))  # longrope: the rows on either side of the switch


def test_the_cost_model_counts_a_sliding_layer_at_its_window(checkpoint):
    cfg = from_hf_config(checkpoint)
    caches = load_causal_lm(checkpoint).new_caches(2, 40)
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(cfg, 2, 40, torch.float32)
    window = cfg.attention_of(0).window
    assert [c.capacity for c in caches] == [min(window or 40, 40)] * cfg.n_layers


def test_the_fused_tensors_split_and_merge_back_exactly(checkpoint):
    hf = io.read_config(checkpoint)
    cfg = from_hf_config(checkpoint)
    tensors, _ = io.read_tensors(checkpoint)
    state = TENSORS.to_attnlab(tensors, cfg)
    attn, d = cfg.attention, cfg.d_model
    assert state["layers.0.attention.wk.weight"].shape == (attn.n_kv_heads * attn.head_dim, d)
    qkv, q_rows, kv_rows = (
        tensors["model.layers.1.self_attn.qkv_proj.weight"],
        d,
        attn.n_kv_heads * attn.head_dim,
    )
    for name, rows in (("wq", slice(0, q_rows)), ("wk", slice(q_rows, q_rows + kv_rows)),
                       ("wv", slice(q_rows + kv_rows, None))):  # fmt: skip
        assert torch.equal(state[f"layers.1.attention.{name}.weight"], qkv[rows])  # [q; k; v] rows
    gate_up = tensors["model.layers.0.mlp.gate_up_proj.weight"]  # [gate; up]: the gate (w1) is the first half
    assert torch.equal(state["layers.0.feed_forward.w1.weight"], gate_up[: cfg.ffn_dim])
    assert torch.equal(state["layers.0.feed_forward.w3.weight"], gate_up[cfg.ffn_dim :])
    back = TENSORS.to_checkpoint(state, cfg)
    kept = {k for k in tensors if not TENSORS.is_ignored(k)}
    if cfg.tie_embeddings:
        assert "lm_head.weight" not in back
    assert set(back) == kept
    for key in kept:
        assert torch.equal(back[key], tensors[key]), key
    assert FAMILIES[hf["model_type"]].tensor_map(hf) is TENSORS


@pytest.mark.parametrize("method", ["mean", "fit"])
def test_convert_rewrites_qkv_proj_and_loads_in_transformers_with_attnlab_logits(
    checkpoint, tmp_path, method
):
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(" ".join(str(i) for i in range(j, j + 20)) for j in range(20)))
    if not (checkpoint / "tokenizer.json").exists():
        _tokenizer(checkpoint)
    args = ("--method", method) + (("--calib", calib) if method == "fit" else ())
    summary = check_convert(checkpoint, tmp_path / "dst", 1, *args)
    check_logits(tmp_path / "dst", n=24)  # longrope: the long factors too (check_convert runs 16 tokens)
    src_cfg = json.loads((checkpoint / "config.json").read_text())
    dst_cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert dst_cfg["num_key_value_heads"] == 1 and summary["n_kv_heads_after"] == 1
    # nothing stale: every other field as the source wrote it
    assert {k: v for k, v in dst_cfg.items() if k != "num_key_value_heads"} == {
        k: v for k, v in src_cfg.items() if k != "num_key_value_heads"
    }
    tensors, _ = io.read_tensors(tmp_path / "dst")
    head_dim, n_heads = 16, src_cfg["num_attention_heads"]
    for i in range(src_cfg["num_hidden_layers"]):
        assert tensors[f"model.layers.{i}.self_attn.qkv_proj.weight"].shape == ((n_heads + 2) * head_dim, 64)
    # mean: each layer's qkv_proj; fit also moves the queries (in qkv_proj) and o_proj
    n_layers = src_cfg["num_hidden_layers"]
    assert summary["tensors_rewritten"] == n_layers * (1 if method == "mean" else 2)


def test_mla_conversion_is_refused_naming_what_the_converter_cannot_keep(checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(tmp_path / "mla"), "--to", "mla",
                                      "--kv-lora-rank", "8"])  # fmt: skip
    assert result.exit_code == 2 and "cannot be converted to MLA" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    cfg = from_hf_config(checkpoint)
    named = {
        "rope_type 'longrope'": bool(cfg.attention.rope_scaling),
        "sliding window of 8": cfg.attention_of(0).window == 8,
    }
    assert {k for k in named if k in result.stderr} == {k for k, v in named.items() if v}
    assert "sliding window of 256" not in result.stderr  # a window past every position is no obstacle
    assert "rotary" not in result.stderr  # nor is partial rotary (Phi-4-mini)
    assert not (tmp_path / "mla").exists()


def test_a_phi3_with_none_of_those_converts_to_mla(tmp_path):
    """The fused layout is no obstacle: a Phi-3 with full rotary, plain RoPE and no window converts as a Llama."""
    src = build(transformers.Phi3Config, tmp_path / "src", **SMALL, max_position_embeddings=64)
    summary = check_convert_mla(src, tmp_path / "mla", "--kv-lora-rank", 16, "--rope-dim", 4)
    assert summary["mla_conversion"] == "approximate" and "qkv_proj" in summary["mla_conversion_note"]
    assert summary["source_rotary_dim"] == 16 and not summary["source_rope_interleaved"]


# Phi-4-mini's attention without its longrope: 12 of 16 dims turn, in half-split pairs of those 12.
PARTIAL = dict(SMALL, partial_rotary_factor=0.75, max_position_embeddings=64, tie_word_embeddings=True)


@torch.no_grad()
def test_partial_rotary_with_one_kv_head_converts_to_mla_exactly(tmp_path):
    # One KV head at full rank keeping all 6 turned planes: the rotary key is the source's 12 turned dims, the 4
    # dims RoPE never turns are the whole no-RoPE part. Exact but for DeepSeek's latent norm, which is measured.
    src = build(transformers.Phi3Config, tmp_path / "src", **(PARTIAL | dict(num_key_value_heads=1)))
    attn = from_hf_config(src).attention
    rank = full_rank(attn, 12)
    summary = check_convert_mla(src, tmp_path / "mla", "--kv-lora-rank", rank)
    assert summary["source_rotary_dim"] == 12 and summary["qk_rope_head_dim"] == 12
    assert summary["qk_nope_head_dim"] == 4 and summary["rope_planes"] == list(range(6))
    assert (
        summary["mla_conversion"] == "approximate" and "4 of 16 head dims" in summary["mla_conversion_note"]
    )
    assert summary["logits_source_vs_mla"]["max_abs"] < 1e-4  # attnlab's MLA, before the latent norm
    x = tokens(24)
    mla = convert_model_to_mla(load_causal_lm(src), rank)
    base = json.loads((src / "config.json").read_text())
    exact = deepseek_without_latent_norm(mla, tmp_path / "bypassed", base)
    source = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    torch.testing.assert_close(exact(x).logits, source(x).logits, rtol=1e-4, atol=1e-4)


def test_partial_rotary_with_several_kv_heads_converts_approximately(tmp_path):
    src = build(transformers.Phi3Config, tmp_path / "src", **(PARTIAL | dict(num_key_value_heads=2)))
    summary = check_convert_mla(src, tmp_path / "mla", "--kv-lora-rank", 24, "--rope-dim", 8)
    assert summary["mla_conversion"] == "approximate" and summary["qk_nope_head_dim"] == 16
    assert summary["rope_planes"] == [0, 1, 2, 3]  # 4 of 6 turned planes: stride 1 is the only one that fits
    assert summary["logits_source_vs_mla"]["max_abs"] > 0  # two KV heads: not exact


def test_compare_reads_the_config(checkpoint):
    result = CliRunner().invoke(app, ["compare", "--model", str(checkpoint / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    native = next(r for r in rows if r["native"])
    assert native["kv_cache_bytes_per_token"] == kv_cache_bytes(from_hf_config(checkpoint), 1, 1, "bf16")


# ---------------------------------------------------------------------------------------- config.json


def _config(**changes) -> dict:
    raw = transformers.Phi3Config(vocab_size=97, **(SMALL | changes)).to_dict()
    return json.loads(json.dumps(raw | {"architectures": ["Phi3ForCausalLM"]}))  # as config.json holds it


def test_older_rope_fields_read_as_transformers_reads_them():
    """``rope_scaling`` of type "su" or "yarn" is longrope (Phi3Config); the top-level
    ``original_max_position_embeddings`` wins over one in the parameters; ``partial_rotary_factor`` inside the
    parameters wins over the top-level one."""
    new = read(Fields(_config(rope_parameters=longrope(8), original_max_position_embeddings=SWITCH,
                              max_position_embeddings=64), "phi3"))  # fmt: skip
    for kind in ("su", "yarn", "longrope"):
        factors = {k: v for k, v in longrope(8).items() if k.endswith("factor")}
        old = dict(
            SMALL,
            model_type="phi3",
            vocab_size=97,
            rope_scaling={"type": kind, **factors, "original_max_position_embeddings": 4096},
            rope_theta=10000.0,
            original_max_position_embeddings=SWITCH,
            max_position_embeddings=64,
        )
        assert read(Fields(old, "phi3")) == new
    both = _config(
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    )
    assert read(Fields(both | {"partial_rotary_factor": 0.75}, "phi3")).attention.rotary_dim == 8
    assert read(Fields(_config(partial_rotary_factor=0.75), "phi3")).attention.rotary_dim == 12


def test_the_writer_changes_only_what_changed_and_reads_back():
    base = _config(
        rope_parameters=longrope(8), original_max_position_embeddings=SWITCH, max_position_embeddings=64
    )
    cfg = read(Fields(base, "phi3"))
    assert write(cfg, base) == base
    fewer = cfg.map_attention(lambda a: a.replace(n_kv_heads=2))
    assert write(fewer, base) == base | {"num_key_value_heads": 2}
    plain = cfg.map_attention(lambda a: a.replace(rope_scaling=(), rope_dim=8, rope_theta=500.0))
    out = write(plain, base)  # RoPE rewritten as rope_parameters, read back the same
    assert read(Fields(out, "phi3")).attention == plain.attention
    assert out["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 500.0,
        "partial_rotary_factor": 0.5,
    }
    with pytest.raises(ValueError, match="no biases"):
        write(cfg.map_attention(lambda a: a.replace(bias=True)), base)
    with pytest.raises(ValueError, match="half-split"):
        write(cfg.map_attention(lambda a: a.replace(rope_interleaved=True)), base)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type='linear' is not supported"),
        (
            dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
            "rope_type='dynamic' is not supported",
        ),
        (dict(partial_rotary_factor=0.5625), "partial_rotary_factor=0.5625 turns 9 of"),  # odd: no pairs
        (dict(partial_rotary_factor=0.1), "partial_rotary_factor=0.1 turns 1 of"),
        (dict(rope_parameters=dict(longrope(8), short_factor=[1.0] * 7)), "short_factor must list 8 numbers"),
        (dict(rope_parameters=dict(longrope(8), long_factor="2")), "long_factor must list 8 numbers"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3 does not divide"),
    ],
)
def test_fields_attnlab_does_not_model_are_refused_in_one_line(tmp_path, changes, message):
    raw = dict(SMALL, model_type="phi3", vocab_size=97) | changes
    with pytest.raises(ValueError, match=r"^phi3 config\.json: ") as err:
        read(Fields(raw, "phi3"))
    assert message in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["compare", "--model", str(tmp_path / "config.json")])
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _tokenizer(path):
    """A word-level tokenizer whose tokens are the numbers the calibration text holds."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({str(i): i for i in range(96)} | {"[UNK]": 96}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
