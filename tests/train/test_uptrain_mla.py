"""``attnlab convert --to mla`` -> ``attnlab uptrain`` -> ``attnlab eval``: the DeepSeek-V3 family goes through
training and evaluation like Llama's. Oracle: transformers' ``DeepseekV3ForCausalLM`` (no remote code)."""

from __future__ import annotations

import json
import math

import torch
import transformers
from safetensors.torch import load_file
from train_helpers import VOCAB, run_cli, snapshot

from attnlab.hf import load_causal_lm


def test_mla_checkpoint_uptrains_and_evaluates(tmp_path, tiny_llama, corpus):
    # 4 heads of 8, 4 KV heads, 2 layers: the cache of GQA with one KV head (16 values) as 12 latent + 4 rotary.
    before = snapshot(tiny_llama)
    mla = tmp_path / "mla"
    args = ["--to", "mla", "--kv-lora-rank", 12, "--rope-dim", 4, "--calib", corpus / "hamlet.txt", "--json"]
    converted = run_cli("convert", tiny_llama, mla, *args)
    assert converted.exit_code == 0, converted.output
    assert json.loads(converted.stdout)["kv_values_per_token_after"] == 2 * 16

    dst = tmp_path / "up"
    result = run_cli(
        "uptrain", mla, dst, "--data", corpus, "--steps", 2, "--batch-size", 4, "--seq-len", 32, "--lr", 3e-3,
        "--warmup", 1, "--teacher", tiny_llama, "--distill-weight", 0.5, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["model_type"] == "deepseek_v3" and summary["steps"] == 2
    assert snapshot(tiny_llama) == before

    # DST is a DeepSeek-V3 checkpoint like the converted one: same config and tensor names, new values.
    assert (dst / "config.json").read_text() == (mla / "config.json").read_text()
    old, new = load_file(mla / "model.safetensors"), load_file(dst / "model.safetensors")
    assert set(old) == set(new)
    assert not torch.equal(
        old["model.layers.0.self_attn.kv_b_proj.weight"], new["model.layers.0.self_attn.kv_b_proj.weight"]
    )
    # The rotary rows were written back interleaved: transformers computes what attnlab computes.
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, load_causal_lm(dst)(x), rtol=1e-5, atol=1e-5)

    # attnlab eval on the held-out play gives the loss uptrain reported.
    scored = run_cli("eval", dst, "--data", corpus / "macbeth.txt", "--seq-len", 32, "--json")
    assert scored.exit_code == 0, scored.output
    evaluation = json.loads(scored.stdout)
    assert evaluation["model_type"] == "deepseek_v3"
    assert math.isclose(evaluation["loss"], summary["eval"]["loss"], rel_tol=1e-6)
