"""A decoder whose attention is any variant and whose block is configured by the model family
(``ModelConfig``; generation: ``attnlab.generate``).

Blocks (``norm_placement``), with ``n1 = attention_norm``, ``n2 = ffn_norm``, ``p1 = post_attention_norm``,
``p2 = post_ffn_norm``:

    pre (Llama)            h = x + attn(n1 x);        out = h + mlp(n2 h)
    sandwich (Gemma 2/3)   h = x + p1(attn(n1 x));    out = h + p2(mlp(n2 h))
    post (OLMo 2)          h = x + p1(attn(x));       out = h + p2(mlp(h))
    parallel (GPT-NeoX)    out = x + attn(n1 x) + mlp(n2 x)

Norms are RMSNorm (gain ``norm_offset + w``: Gemma's ``1 + w``; applied before the cast back from float32 with
``norm_gain_float32``, as OLMo 2) or LayerNorm with a bias; the MLP is SwiGLU
(``w2(silu(w1 x) * w3 x)``), GeGLU (tanh GELU in place of SiLU) or plain GELU (``w2(gelu(w1 x))``); RoPE, q/k norms,
the softmax scale, logit soft-capping and sliding windows live in the attention (``AttentionConfig``; a layer's own
is ``cfg.attention_of(i)``). Token embeddings may be scaled (``embed_scale``: Gemma's sqrt(d_model), in the
activations' dtype) and the logits soft-capped (``final_softcap``). Module names follow Meta's llama3 ``model.py``
(tok_embeddings, layers.N.attention.wq, feed_forward.w1/w2/w3, norm, output) so that checkpoint key maps stay short.
Shapes: tokens (B, T) int64 -> logits (B, T, vocab_size) float32.

Positions: ``position_ids`` (T,) or (B, T) if given (a left-padded batch: ``attention_mask.cumsum(-1) - 1``; packed
sequences: restarting at 0 per document, with a block-diagonal ``attn_mask``), else following the caches, else
0 .. T - 1. The RoPE angles are computed once per forward and shared by the layers (once per rotary shape).

Decode steps: a GQA/MHA/MQA block given one new token per row and a contiguous ``KVCache`` runs as one call of
the fused C++ block operator (``fused.BlockStep``: norms, projections, RoPE, cache write, attention, MLP) instead
of ~25 PyTorch ops, when its configuration is one the kernel computes exactly (``fused_block_config``: Llama's
block, any RoPE frequencies, full rotary, no q/k norm, soft-capping or window ring), nothing is hooked on its
modules, and the backend table gives the layer's attention a backend with a block step for this call
(``backends.choose``: CPU, float32/bfloat16, no gradient, no tensor subclass, the kernels built; ``_FusedPlan``);
the result equals the module-by-module forward up to the order of float32 sums (tests/test_block_step.py).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .attention import fused
from .attention.backends import Call, choose
from .attention.gqa import GroupedQueryAttention
from .attention.linear import Linear, project
from .attention.mla import MultiHeadLatentAttention
from .attention.norm import RMSNorm, make_norm
from .attention.rope import RopeAngles, token_positions
from .cache import Cache, KVCache, LatentCache, StaticKVCache
from .config import GATED_MLPS, AttentionConfig, MLAConfig, ModelConfig

_LINEARS = (Linear, nn.Linear)
_PLAIN = (torch.Tensor, nn.Parameter)  # what the kernels take as plain tensors (not a DTensor)


def _global_hooks() -> bool:
    """Whether any module-wide forward hook is registered (``nn.modules.module.register_module_forward_hook``)."""
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks)


_ACTIVATIONS = {
    "swiglu": F.silu,
    "geglu": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class FeedForward(nn.Module):
    """The MLP: gated (``kind`` "swiglu", "geglu": ``w2(act(w1 x) * w3 x)``) or plain ("gelu", "gelu_tanh":
    ``w2(act(w1 x))``, no ``w3``)."""

    def __init__(self, d_model: int, ffn_dim: int, bias: bool = False, kind: str = "swiglu") -> None:
        super().__init__()
        if kind not in _ACTIVATIONS:
            raise ValueError(f"FeedForward kind must be one of {', '.join(_ACTIVATIONS)}; got {kind!r}")
        self.kind = kind
        self.w1 = Linear(d_model, ffn_dim, bias=bias)  # gate (gated) or up (plain)
        self.w2 = Linear(ffn_dim, d_model, bias=bias)  # down
        if kind in GATED_MLPS:
            self.w3 = Linear(d_model, ffn_dim, bias=bias)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = _ACTIVATIONS[self.kind]
        if self.kind not in GATED_MLPS:
            return self.w2(act(self.w1(x)))
        gate, up = project(x, self.w1, self.w3)
        if torch.is_grad_enabled() or self.kind != "swiglu":
            return self.w2(act(gate) * up)
        return self.w2(F.silu(gate, inplace=True).mul_(up))  # same values, two fewer (T, hidden) buffers


def fused_block_config(cfg: ModelConfig, attn: AttentionConfig | MLAConfig) -> bool:
    """Whether the fused C++ block step computes a block of this configuration exactly: Llama's block (pre RMSNorms
    with gain w applied after the cast back, sequential residuals, SwiGLU) around GQA/MHA/MQA without RoPE, or with RoPE on every head dim in
    half-split pairs (any frequencies: the angles are computed in Python); no q/k norm and no logit soft-capping. A sliding window is
    fine while the layer's cache holds every token (``_FusedPlan.of`` checks that per step)."""
    return (
        cfg.norm == "rmsnorm"
        and cfg.norm_offset == 0
        and not cfg.norm_gain_float32
        and cfg.norm_placement == "pre"
        and not cfg.parallel_residual
        and cfg.mlp == "swiglu"
        and isinstance(attn, AttentionConfig)
        and attn.head_dim % 2 == 0  # the kernel's heads come in pairs of dims, with or without RoPE
        and (not attn.rope or (attn.rotary_dim == attn.head_dim and not attn.rope_interleaved))
        and attn.qk_norm == "none"
        and attn.softcap is None
    )


class _FusedPlan:
    """A block's decode step as one call of the fused kernel (``fused.BlockStep``), when it can take it: a
    GQA/MHA/MQA block of this file's modules with nothing hooked on them, one new token per row over a contiguous
    ``KVCache``, in eval mode, and a backend for its attention (``backends.choose``, asked once per step with the
    layer's configured backend) that has a block step for this call. Anything else runs module by module.

    Built once per block and kept outside it (in ``_PLANS``; the module stays picklable), because gathering the
    operands costs ~20 module attribute lookups of microseconds each. Every step checks cheaply that the plan is
    still the block's: the same submodules and parameter tensors at the same addresses (``Module.to`` swaps a
    parameter's data in place), no hooks, no gradient to record.
    """

    def __init__(self, block: Block) -> None:
        attn, ffn = block.attention, block.feed_forward
        self.modules: tuple[nn.Module, ...] = tuple(block.children())
        self.guards: list[tuple[dict, str, object]] = [
            (block._modules, n, m) for n, m in block.named_children()
        ]
        self.params: tuple[torch.Tensor, ...] = ()
        self.addresses: tuple[int, ...] = ()
        self.step: fused.BlockStep | None = None
        self.rope_spec = None
        self.subclass = False  # a parameter of a tensor subclass (a DTensor, sharded)
        # the configurations read below (a new one, as MLA's mode setter and users assign, makes a new plan)
        self.guards += [(vars(block), "cfg", block.cfg), (vars(attn), "cfg", attn.cfg)]
        if not fused_block_config(block.cfg, attn.cfg):  # the configuration decides, not the modules' types
            return
        norms = (block.attention_norm, block.ffn_norm)
        if type(attn) is not GroupedQueryAttention or type(ffn) is not FeedForward:  # replaced by a user
            return
        linears = (attn.wq, attn.wk, attn.wv, attn.wo, ffn.w1, ffn.w3, ffn.w2)
        self.modules += linears
        for parent in (attn, ffn):
            self.guards += [(parent._modules, n, m) for n, m in parent.named_children()]
        for m in (*norms, *linears):
            self.guards += [(m._parameters, n, p) for n, p in m._parameters.items()]
        self.guards += [(vars(m), "eps", m.eps) for m in norms if "eps" in vars(m)]
        self.params = tuple(p for m in (*norms, *linears) for p in m._parameters.values() if p is not None)
        self.addresses = tuple(p.data_ptr() for p in self.params)
        self.subclass = any(type(p) not in _PLAIN for p in self.params)
        if (
            any(type(m) is not RMSNorm for m in norms)
            or any(type(m) not in _LINEARS for m in linears)
            or block.attention_norm.eps != block.ffn_norm.eps
            or not all(p.is_contiguous() and p.dtype == attn.wq.weight.dtype for p in self.params)
        ):
            return
        self.rope_spec = attn.rope_spec
        by_name = dict(zip(("q", "k", "v", "o", "1", "3", "2"), linears, strict=True))  # wq .. w2, bq .. b2
        weights = fused.BlockWeights(
            attn_norm=block.attention_norm.weight,
            ffn_norm=block.ffn_norm.weight,
            **{f"w{name}": m.weight for name, m in by_name.items()},
            **{f"b{name}": m.bias for name, m in by_name.items()},
        )
        self.step = fused.BlockStep(
            weights,
            head_dim=attn.head_dim,
            eps=block.attention_norm.eps,
            scale=attn.cfg.softmax_scale,
        )

    def current(self) -> bool:
        return all(d.get(k) is v for d, k, v in self.guards) and all(
            p.data_ptr() == a for p, a in zip(self.params, self.addresses, strict=True)
        )

    @staticmethod
    def of(block: Block, x: torch.Tensor, cache: KVCache) -> _FusedPlan | None:
        """The block's plan if its fused step can take this call, else None."""
        if torch.compiler.is_compiling():  # the plan's checks read data pointers, which tracing does not have
            return None
        # the kernel is for CPUs: on a GPU no plan is made or checked, every block, every step
        if x.device.type != "cpu" or x.ndim != 3 or x.shape[1] != 1 or x.shape[0] == 0:
            return None
        # the kernel computes in the block's dtype; under autocast the modules' ops cast as it says
        if torch.is_autocast_enabled("cpu"):
            return None
        plan = _PLANS.get(block)
        if plan is None or not plan.current():
            plan = _PLANS[block] = _FusedPlan(block)
        step = plan.step
        if step is None or x.dtype != step.dtype:
            return None
        if (
            cache.dtype != x.dtype
            or cache.k.device != x.device
            or (cache.n_kv_heads, cache.head_dim) != (step.n_kv, step.head_dim)
            or cache.pos + 1 > cache.capacity  # a window's ring is full: the kernel attends to slots 0 .. pos
            or cache.window != block.attention.cfg.window  # not the layer's ring: the module's own step
        ):
            return None
        if any(m._forward_hooks or m._forward_pre_hooks for m in plan.modules) or _global_hooks():
            return None
        grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in plan.params))
        call = Call(
            device=x.device.type,
            dtype=x.dtype,
            phase="decode",
            grad=grad,
            subclass=plan.subclass or type(x) not in _PLAIN,
            block=x.shape[0],
        )
        return plan if choose(call, block.attention.cfg.backend).backend is not None else None

    def run(
        self,
        block: Block,
        x: torch.Tensor,
        cache: KVCache,
        position_ids: torch.Tensor | None,
        rope: RopeAngles | None,
    ) -> torch.Tensor:
        angles = None
        if self.rope_spec is not None:
            if rope is None:
                rope = RopeAngles(token_positions(position_ids, cache, x.shape[0], 1, x.device))
            angles = rope.get(*self.rope_spec)
        pos = cache.claim(x.shape[0], 1, x.dtype)
        try:
            return self.step(x.contiguous(), angles, cache.k, cache.v, pos)  # type: ignore[misc]
        except BaseException:
            cache.pos = pos  # a failed step leaves the cache as it was
            raise


_PLANS: weakref.WeakKeyDictionary[nn.Module, _FusedPlan] = weakref.WeakKeyDictionary()


def _unit_gain(norm: nn.Module) -> None:
    """A norm's initial weights: a gain of 1 (weight 1 - offset for Gemma's ``1 + w``), a zero bias."""
    nn.init.constant_(norm.weight, 1.0 - getattr(norm, "offset", 0.0))
    if getattr(norm, "bias", None) is not None:
        nn.init.zeros_(norm.bias)


class Block(nn.Module):
    """One decoder layer (the module docstring's table): its attention is ``cfg.attention_of(layer)``."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        attn = cfg.attention_of(layer)
        self.attention = (
            GroupedQueryAttention(attn)
            if isinstance(attn, AttentionConfig)
            else MultiHeadLatentAttention(attn)
        )
        d, eps = cfg.d_model, cfg.norm_eps
        if cfg.norm_placement != "post":
            self.attention_norm = make_norm(cfg.norm, d, eps, cfg.norm_offset, cfg.norm_gain_float32)
        self.feed_forward = FeedForward(d, cfg.ffn_dim, bias=cfg.mlp_bias, kind=cfg.mlp)
        if cfg.norm_placement != "post":
            self.ffn_norm = make_norm(cfg.norm, d, eps, cfg.norm_offset, cfg.norm_gain_float32)
        if cfg.norm_placement != "pre":
            self.post_attention_norm = make_norm(cfg.norm, d, eps, cfg.norm_offset, cfg.norm_gain_float32)
            self.post_ffn_norm = make_norm(cfg.norm, d, eps, cfg.norm_offset, cfg.norm_gain_float32)

    def forward(
        self,
        x: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        position_ids: torch.Tensor | None = None,
        rope: RopeAngles | None = None,
    ) -> torch.Tensor:
        if attn_mask is None and type(cache) is KVCache and not self.training:
            step = _FusedPlan.of(self, x, cache)
            if step is not None:
                return step.run(self, x, cache, position_ids, rope)
        placement = self.cfg.norm_placement
        context = dict(attn_mask=attn_mask, cache=cache, position_ids=position_ids, rope=rope)
        a = self.attention(x if placement == "post" else self.attention_norm(x), **context)
        if placement != "pre":
            a = self.post_attention_norm(a)
        if self.cfg.parallel_residual:  # x + attention(n1 x) + mlp(n2 x)
            return x + a + self.feed_forward(self.ffn_norm(x))
        if torch.is_grad_enabled():
            h = x + a
        else:
            h = a.add_(x)  # inference: the sums in place (a + x is x + a to the bit)
        m = self.feed_forward(h if placement == "post" else self.ffn_norm(h))
        if placement != "pre":
            m = self.post_ffn_norm(m)
        return h + m if torch.is_grad_enabled() else m.add_(h)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        if cfg.is_moe:
            raise ValueError(f"attnlab.model builds dense models only; ModelConfig.n_experts={cfg.n_experts}")
        if cfg.n_positions or cfg.n_token_types or cfg.pooler:
            raise ValueError(
                "attnlab.model builds rotary decoders; learned positions and poolers are the cost model's"
            )
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_offset, cfg.norm_gain_float32)
        self.output = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """GPT-2-style init: N(0, std), residual output projections scaled by 1/sqrt(2 * n_layers)."""
        if seed is not None:
            torch.manual_seed(seed)
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers:
            layer.attention.init_weights(std, out_std)
            ffn = layer.feed_forward
            linears = [ffn.w1, ffn.w2, *([ffn.w3] if hasattr(ffn, "w3") else [])]
            for lin in linears:
                nn.init.normal_(lin.weight, std=out_std if lin is ffn.w2 else std)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
            for module in layer.children():
                if isinstance(module, (RMSNorm, nn.LayerNorm)):
                    _unit_gain(module)
        _unit_gain(self.norm)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)

    def new_caches(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        static: bool = False,
    ) -> list[KVCache | LatentCache] | list[StaticKVCache]:
        """One cache per layer; ``max_seq_len`` defaults to the config's. ``static``: ``StaticKVCache``s, whose
        shapes and Python state never change between decode steps (for ``torch.compile`` and CUDA graphs)."""
        max_seq_len = self.cfg.max_seq_len if max_seq_len is None else max_seq_len
        return [
            layer.attention.new_cache(batch_size, max_seq_len, dtype, device, static=static)
            for layer in self.layers
        ]

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        caches: list[Cache] | None = None,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits (B, T, vocab_size) of ``tokens`` (B, T); ``attn_mask`` (bool, True = attend) is applied in
        every layer together with the causal rule; see the module docstring for ``position_ids``. With a longrope
        model, keys cached by forwards shorter than its ``original_max_position_embeddings`` are stale once the
        sequence passes it (its angles change): ``attnlab.generate`` prefills again there, a loop of your own must.

        ``logits_to_keep`` > 0 scores only the last that many positions (B, logits_to_keep, vocab_size), as
        transformers' argument of that name: a prefill needs the last position only, and the output head costs
        a (vocab_size x d_model) product per position scored."""
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (B, T), got shape {tuple(tokens.shape)}")
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(f"caches has {len(caches)} entries for {len(self.layers)} layers")
        if caches is not None and None in caches:  # that layer would attend to the new tokens alone
            raise ValueError(
                f"caches[{list(caches).index(None)}] is None: give every layer a cache, or pass caches=None"
            )
        # an id outside the table is an IndexError deep in the embedding (on a GPU a device-side assert); checked
        # where reading two numbers back costs nothing: on a CPU, outside a compiled graph
        if tokens.numel() and tokens.device.type == "cpu" and not torch.compiler.is_compiling():
            lo, hi = torch.aminmax(tokens)
            if lo < 0 or hi >= self.cfg.vocab_size:
                bad = int(lo) if lo < 0 else int(hi)
                raise ValueError(f"tokens hold id {bad}, outside the vocabulary [0, {self.cfg.vocab_size})")
        b, t = tokens.shape
        rope = RopeAngles(token_positions(position_ids, caches[0] if caches else None, b, t, tokens.device))
        x = self.tok_embeddings(tokens)
        if self.cfg.embed_scale != 1.0:  # in the activations' dtype, as Gemma multiplies
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, attn_mask=attn_mask, cache=None if caches is None else caches[i], rope=rope)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.output(self.norm(x)).float()
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
