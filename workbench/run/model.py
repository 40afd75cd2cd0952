"""A small byte-level decoder-only transformer in the shape of nanoGPT.

After Karpathy's nanoGPT ``model.py`` (https://github.com/karpathy/nanoGPT), itself GPT-2
(Radford et al., 2019): learned position embeddings, pre-LayerNorm blocks with causal
self-attention and a 4x GELU MLP, a final LayerNorm and an output head tied to the token
embedding. The vocabulary is the 256 byte values, so no tokenizer is needed.

Phases: ``ModelConfig`` (with presets) -> ``build_model`` (seeded, bit-reproducible across
processes) -> ``GPT.forward``. ``pick_device`` and ``autocast_context`` keep device handling
in one place for the CLI, the TUI and notebooks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = [
    "GPT",
    "PRESETS",
    "ModelConfig",
    "autocast_context",
    "build_model",
    "medium",
    "pick_device",
    "preset",
    "small",
    "tiny",
]


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of a :class:`GPT`. Checked when built; see :meth:`validate`."""

    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 6
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 192
    """Width of the residual stream (channels, C)."""
    block_size: int = 128
    """Context length in bytes (T at most)."""
    dropout: float = 0.0
    """Dropout probability in [0, 1) for attention, residual and embedding outputs."""
    vocab_size: int = 256
    """Number of token values; 256 for raw bytes."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` saying what is wrong and how to fix it."""
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"ModelConfig.{name}={value!r} must be a positive integer; set it to 1 or more."
                )
        if self.n_embd % self.n_head != 0:
            fixed = self.n_head * math.ceil(self.n_embd / self.n_head)
            raise ValueError(
                f"ModelConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"choose n_embd as a multiple of n_head (e.g. n_embd={fixed}) or change n_head."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"ModelConfig.dropout={self.dropout!r} is outside [0, 1); use 0.0 to disable dropout or a value like 0.1."
            )
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ValueError(
                f"ModelConfig.vocab_size={self.vocab_size!r} must be an integer of at least 2; use 256 for bytes."
            )


# --- presets: small is the defaults, the others build on it ---------------------------------


def small() -> ModelConfig:
    """The defaults: 4 layers, 192 wide, 128-byte context (~1.8M parameters)."""
    return ModelConfig()


def tiny() -> ModelConfig:
    """For tests and smoke runs: 2 layers, 64 wide, 64-byte context (~0.1M parameters)."""
    return replace(small(), n_layer=2, n_head=2, n_embd=64, block_size=64)


def medium() -> ModelConfig:
    """6 layers, 384 wide, 256-byte context (~10.8M parameters); wants a GPU."""
    return replace(small(), n_layer=6, n_head=6, n_embd=384, block_size=256)


PRESETS: dict[str, Callable[[], ModelConfig]] = {"tiny": tiny, "small": small, "medium": medium}
"""Preset name -> function building a fresh :class:`ModelConfig`."""


def preset(name: str) -> ModelConfig:
    """Return a fresh config for preset ``name``."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}.") from None


# --- the network ----------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head masked self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)  # residual projection
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)  # residual projection
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes. ``forward(idx, targets)`` -> ``(logits, loss)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): one (vocab, C) matrix embeds and un-embeds.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale residual projections so the residual stream's variance does not grow
        # with depth (two residual additions per block).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of distinct parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T, vocab)`` for byte ids ``idx`` ``(B, T)``; mean cross-entropy if ``targets``."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}; add a batch dimension.")
        B, T = idx.shape
        if idx.size(1) > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}; "
                f"raise ModelConfig.block_size or crop the input to the last {self.config.block_size} tokens."
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss


def build_model(config: ModelConfig, *, seed: int) -> GPT:
    """Build a :class:`GPT` on the CPU whose initial parameters depend only on ``seed``.

    The initialisation runs under a forked, freshly seeded CPU RNG, so two processes (peers)
    with the same seed get bit-identical parameters whatever else they drew first, and the
    caller's global RNG state is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    logger.debug("built GPT with %d parameters (seed=%d, %s)", model.num_params(), seed, config)
    return model


# --- devices ----------------------------------------------------------------------------------


def pick_device(requested: str = "auto") -> torch.device:
    """Resolve ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` to a usable device. In a
    torchrun node (``LOCAL_RANK`` set, several processes) ``auto`` and ``cuda`` are the local
    rank's GPU: plain ``cuda`` is GPU 0, where every rank of an 8-GPU node put its model."""
    if requested == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if requested in ("auto", "cuda") and torch.cuda.is_available() and (local := _local_rank()) is not None:
        index = local % torch.cuda.device_count()  # more ranks than GPUs: they share, in turn
        torch.cuda.set_device(index)
        return torch.device(f"cuda:{index}")
    if requested == "auto":
        return torch.device("cuda")
    if requested == "cuda" or (requested.startswith("cuda:") and requested[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} requested but no CUDA device found; use --device cpu.")
        if ":" in requested and int(requested[5:]) >= torch.cuda.device_count():
            raise ValueError(
                f"device {requested!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist; "
                f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}."
            )
        return torch.device(requested)
    raise ValueError(f"unknown device {requested!r}; use one of: auto, cpu, cuda, cuda:N.")


def _local_rank() -> int | None:
    """torchrun's ``LOCAL_RANK`` where a node runs several processes, else None."""
    local = os.environ.get("LOCAL_RANK", "")
    processes = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1"
    return int(local) if local.isdigit() and processes.isdigit() and int(processes) > 1 else None


def autocast_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast on CUDA; a no-op elsewhere (CPU runs stay in float32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
