"""RoPE: our half-split rotation against a complex-number oracle, and the interleaved -> half-split transform.

The oracle writes RoPE the way the papers do (RoFormer, arXiv 2104.09864): a pair of coordinates is one complex
number multiplied by ``exp(i * pos * theta_j)``, with ``theta_j = base ** (-2j / D)``. Half-split pairs are
``(x[j], x[j + D/2])``; interleaved pairs (Meta's original checkpoints, DeepSeek's) are ``(x[2j], x[2j + 1])``.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.rope import (
    apply_rope,
    interleaved_to_half_split,
    inverse_frequencies,
    rope_cos_sin,
    switch_length,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _angles(positions: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    j = torch.arange(dim // 2, dtype=torch.float64)
    return positions.double()[:, None] * base ** (-2.0 * j / dim)  # (T, dim/2)


def _oracle_half_split(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
        torch.ones(1, dtype=torch.float64), _angles(positions, x.shape[-1], base)
    )
    return torch.cat((z.real, z.imag), dim=-1)


def _oracle_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double()) * torch.polar(
        torch.ones(1, dtype=torch.float64), _angles(positions, x.shape[-1], base)
    )
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)  # back to (re, im, re, im, ...)


@pytest.mark.parametrize("dim", [2, 8, 40, 128])
def test_apply_rope_equals_complex_rotation(dim):
    x = torch.randn(2, 3, 11, dim)
    positions = torch.arange(5, 16)
    cos, sin = rope_cos_sin(positions, dim, theta=10000.0)
    assert cos.shape == sin.shape == (11, dim)
    got = apply_rope(x, cos, sin)
    assert (got.double() - _oracle_half_split(x, positions, 10000.0)).abs().max() <= 1e-4 * (1 + 15)


def test_rope_position_zero_is_identity_and_norms_are_kept():
    x = torch.randn(1, 2, 6, 16)
    cos, sin = rope_cos_sin(torch.arange(6), 16, theta=500.0)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    q, k = torch.randn(2, 8), torch.randn(2, 8)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([pq]), 8, 10000.0)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 8, 10000.0)
        return (apply_rope(q[:1], cq, sq) @ apply_rope(k[:1], ck, sk).T).item()

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_rope_keeps_bfloat16_and_matches_float32():
    x = torch.randn(1, 1, 9, 32)
    cos, sin = rope_cos_sin(torch.arange(100, 109), 32, 10000.0)
    y16 = apply_rope(x.bfloat16(), cos, sin)
    assert y16.dtype == torch.bfloat16
    assert (y16.float() - apply_rope(x, cos, sin)).abs().max() <= 2e-2  # one bfloat16 rounding of |x| <~ 4


@pytest.mark.parametrize("dim", [2, 4, 8, 64])
def test_interleaved_to_half_split_is_the_named_permutation(dim):
    perm = interleaved_to_half_split(dim)
    assert perm.dtype == torch.int64
    assert sorted(perm.tolist()) == list(range(dim))  # a permutation
    assert perm.tolist() == [*range(0, dim, 2), *range(1, dim, 2)]
    # Pair (2j, 2j+1) lands on (j, j + dim/2).
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(dim)
    for j in range(dim // 2):
        assert (inverse[2 * j].item(), inverse[2 * j + 1].item()) == (j, j + dim // 2)


@pytest.mark.parametrize("dim", [4, 16, 64])
def test_interleaved_weights_permuted_give_half_split_rope_the_same_rotation(dim):
    """For projection rows laid out interleaved, ``w[perm]`` + half-split RoPE == interleaved RoPE, permuted."""
    perm = interleaved_to_half_split(dim)
    w_interleaved = torch.randn(dim, 12)
    x = torch.randn(7, 12)
    positions = torch.arange(3, 10)
    rotated_interleaved = _oracle_interleaved(x @ w_interleaved.T, positions, 10000.0)
    cos, sin = rope_cos_sin(positions, dim, 10000.0)
    rotated_half = apply_rope(x @ w_interleaved[perm].T, cos, sin)
    assert (rotated_half.double() - rotated_interleaved[:, perm]).abs().max() <= 1e-4
    # Attention scores (q . k) need no output permutation at all: they are the same number.
    k_inter = _oracle_interleaved(torch.randn(7, dim), positions, 10000.0)
    scores_inter = rotated_interleaved @ k_inter.T
    scores_half = rotated_half.double() @ k_inter[:, perm].T
    assert (scores_half - scores_inter).abs().max() <= 1e-3
    # Without the permutation the rotation is a different one (the classic conversion bug).
    wrong = apply_rope(x @ w_interleaved.T, cos, sin)
    assert (wrong.double() - rotated_interleaved[:, perm]).abs().max() > 1e-2


def test_interleaved_to_half_split_rejects_odd_dim():
    with pytest.raises(ValueError, match=r"rotary dim must be even, got 7"):
        interleaved_to_half_split(7)


def test_longrope_rows_of_a_batch_turn_as_they_turn_alone():
    """longrope's factors follow a forward's length, taken per row: a row of a left-padded or paged batch that is
    at most ``original_max_position_embeddings`` long keeps the short factors beside a longer row."""
    scaling = (
        ("long_factor", (4.0, 8.0, 16.0, 32.0)),
        ("max_position_embeddings", 32),
        ("original_max_position_embeddings", 8),
        ("rope_type", "longrope"),
        ("short_factor", (1.0, 1.5, 2.0, 2.5)),
    )
    assert switch_length(scaling) == 8 and switch_length(()) is None
    short, long = torch.arange(3, 8), torch.arange(10, 15)  # forwards of 8 and 15 tokens
    cos, sin = rope_cos_sin(torch.stack((short, long)), 8, 10000.0, scaling=scaling)
    for row, positions in enumerate((short, long)):
        alone = rope_cos_sin(positions[None], 8, 10000.0, scaling=scaling)
        torch.testing.assert_close((cos[row : row + 1], sin[row : row + 1]), alone, rtol=0, atol=0)
    for row, (positions, length) in enumerate(((short, 8), (long, 15))):  # short, then long factors
        inv_freq, factor = inverse_frequencies(8, 10000.0, scaling, seq_len=length)
        freqs = positions[:, None].float() * inv_freq
        torch.testing.assert_close(cos[row], torch.cat((freqs, freqs), -1).cos() * factor)
    assert not torch.equal(*(inverse_frequencies(8, 10000.0, scaling, seq_len=n)[0] for n in (8, 9)))
