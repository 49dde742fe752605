"""A small modern GPT: decoder-only transformer that never attends across packed documents.

    from datapipe.train.model import GPT, ModelConfig
    model = GPT(ModelConfig(vocab_size=8192, n_layer=4, n_head=4, d_model=256))
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"])

Blocks are pre-norm: x + attn(rmsnorm(x)), x + swiglu(rmsnorm(x)), then a final RMSNorm and the
(optionally tied) output projection. No biases anywhere. Rotary positions are applied with the
batch's `position_ids`, which restart at every document, so a document sees the same positions
whether it is packed or alone.

Attention respects the packed pieces' boundaries (packing puts several documents in one row).
The segments are the batch's `cu_seqlens` (or its per-token `segment_ids`, the same segments
numbered), never `doc_ids`: a document drawn twice can sit twice in one row with one id, and each
copy must see only itself. Every path uses the same segments:
- 'sdpa' (portable, the CPU path): `F.scaled_dot_product_attention` with a dense boolean
  block-causal mask of the segments (`packing.block_causal_mask`). Padding forms its own segment,
  so no real token ever attends to it and no mask row is empty.
- 'varlen' (CUDA): `torch.nn.attention.varlen.varlen_attn` (FlashAttention) over the flattened
  batch, one causal sequence per `cu_seqlens` segment; needs bf16/fp16.
- 'flex' (CUDA): FlexAttention with a block mask of the segments; compiled once.
'auto' picks varlen on CUDA when torch has it, else flex, and sdpa on CPU.
The CUDA paths are written against torch 2.13's API but were not run on this project's CPU-only
machine; `tests/datapipe/test_model.py::test_cuda_paths_match_sdpa` checks them where CUDA exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from datapipe.core.config import check, note
from datapipe.loader.packing import IGNORE_INDEX, block_causal_mask, segment_ids_of

Attention = Literal["auto", "sdpa", "flex", "varlen"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int | None = note(None, help="token ids the embedding holds; null = the shards' manifest tokenizer vocab_size")
    n_layer: int = note(4, help="transformer blocks")
    n_head: int = note(4, help="attention heads; d_model must be a multiple")
    d_model: int = note(256, help="residual stream width")
    mlp_hidden: int | None = note(None, help="SwiGLU hidden width; null = 8/3 * d_model rounded up to a multiple of 64")
    max_seq_len: int = note(2048, help="longest position the rotary table covers (>= data.seq_len)")
    rope_theta: float = note(10000.0, help="rotary base frequency")
    tie_embeddings: bool = note(True, help="share the input embedding and the output projection")
    norm_eps: float = note(1e-6, help="RMSNorm epsilon")
    init_std: float = note(0.02, help="std of the normal init of every matrix (output projections scaled by 1/sqrt(2*n_layer))")
    attention: Attention = note("auto", help="'auto' (varlen/flex on CUDA, sdpa on CPU), 'sdpa', 'flex' or 'varlen'")

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "max_seq_len"):
            check(getattr(self, name) >= 1, f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        check(self.vocab_size is None or self.vocab_size >= 2, f"vocab_size must be null or >= 2, got {self.vocab_size!r}")
        check(self.d_model % self.n_head == 0,
              f"d_model must be a multiple of n_head={self.n_head}, got {self.d_model!r}")
        check((self.d_model // self.n_head) % 2 == 0,
              f"d_model / n_head (the head size) must be even for rotary positions, got {self.d_model // self.n_head!r}")
        check(self.mlp_hidden is None or self.mlp_hidden >= 1, f"mlp_hidden must be null or >= 1, got {self.mlp_hidden!r}")
        check(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 64 * math.ceil(8 * self.d_model / 3 / 64)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 even under bf16 autocast: the mean of squares loses precision otherwise
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, S, H, D); cos/sin: (B, S, D/2), already gathered at each token's position."""
    x1, x2 = x.float().chunk(2, dim=-1)  # rotate-half layout (as Llama/NeoX)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


_flex_compiled = None


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """FlexAttention with a segment-causal block mask (CUDA). q, k, v: (B, H, S, D); segments: (B, S)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:  # uncompiled flex_attention materialises the scores: compile once
        _flex_compiled = torch.compile(flex_attention, dynamic=False)

    def segment_causal(b, h, q_idx, kv_idx):
        return (segments[b, q_idx] == segments[b, kv_idx]) & (q_idx >= kv_idx)

    B, _, S, _ = q.shape
    mask = create_block_mask(segment_causal, B, None, S, S, device=q.device)
    return _flex_compiled(q, k, v, block_mask=mask)


def resolve_attention(kind: str, device: torch.device) -> str:
    if kind != "auto":
        return kind
    if device.type == "cuda":
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401

            return "varlen"
        except ImportError:
            return "flex"
    return "sdpa"


class DocumentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, kind: str,
                mask: torch.Tensor | None, segments: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_head, self.head_dim).unbind(dim=2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kind == "varlen":
            from torch.nn.attention.varlen import varlen_attn

            flat = lambda t: t.reshape(B * S, self.n_head, self.head_dim)  # noqa: E731
            cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
            # seq_len bounds every segment, so no device->host sync is needed to find the longest
            y = varlen_attn(flat(q), flat(k), flat(v), cu, cu, S, S, window_size=(-1, 0)).view(B, S, -1)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
            if kind == "flex":
                y = _flex_attention(q, k, v, segments)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
            y = y.transpose(1, 2).reshape(B, S, -1)
        return self.proj(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = DocumentAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attn) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, **attn)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check(cfg.vocab_size is not None, "vocab_size must be set before building the model (from the manifest)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.d_model // cfg.n_head, cfg.max_seq_len, cfg.rope_theta)
        # not persistent: derived from the config, so checkpoints hold only learned weights
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: scale the residual outputs down by depth
            for w in (block.attn.proj.weight, block.mlp.down.weight):
                nn.init.normal_(w, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.init_std)

    def num_params(self, *, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B: 6N plus the attention scores, 12·L·d·S)."""
        return 6 * self.num_params(non_embedding=False) + 12 * self.cfg.n_layer * self.cfg.d_model * seq_len

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, S, vocab) in fp32.

        The attention segments (packed pieces) come from `cu_seqlens` (the flattened batch's
        boundaries) or `segment_ids` (B, S); with neither, each row is one sequence (plain causal).
        `doc_ids` is accepted for callers that pass the whole batch, and never used for attention:
        two copies of one document in a row share an id. Given alone it is refused, since the
        segments cannot be told from it.
        attn_mask (B, S, S), True = may attend, replaces the segment mask (sdpa): preference packing
        (datapipe/loader/preference_packing.py) needs a response to see the prompt but not the other response.
        """
        B, S = input_ids.shape
        if S > self.cfg.max_seq_len:
            raise ValueError(f"input length must be <= model.max_seq_len={self.cfg.max_seq_len}, got {S!r}")
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        if segment_ids is None and cu_seqlens is not None:
            segment_ids = segment_ids_of(cu_seqlens.to(input_ids.device), S, batch_size=B)
        if segment_ids is None:
            if doc_ids is not None and attn_mask is None:
                raise ValueError("pass cu_seqlens (or segment_ids) with doc_ids: attention segments are the packed "
                                 "pieces, and doc_ids cannot separate two copies of one document in a row")
            segment_ids = torch.zeros_like(input_ids)
        kind = resolve_attention(self.cfg.attention, input_ids.device)
        if kind == "varlen" and cu_seqlens is None:
            kind = "flex"
        if attn_mask is not None:
            kind = "sdpa"
        mask = attn_mask if attn_mask is not None else (block_causal_mask(segment_ids) if kind == "sdpa" else None)
        cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, kind=kind, mask=mask, segments=segment_ids, cu_seqlens=cu_seqlens)
        return self.head(self.norm(x)).float()


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every token, (B, S); 0 where labels are IGNORE_INDEX (-100)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(labels.shape)
