"""A small GPT (decoder-only transformer) and deterministic synthetic token data.

Defaults are tiny so a 4-worker job trains on a 2-core CPU machine in seconds per step.
No dropout: the loss at step N must depend only on the weights and the step's samples.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        # Causal attention through SDPA: a flash kernel on GPUs (the MFU benchmark), plain math on CPU.
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(h)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int = 256, seq_len: int = 32, d_model: int = 64, n_layers: int = 2,
                 n_heads: int = 4, forward_delay_s: float = 0.0):
        super().__init__()
        self.seq_len = seq_len
        # Stands in for the compute of a bigger model, so tests on a 2-core machine can pace
        # steps (and leave time for a replacement worker to start) without burning CPU.
        self.forward_delay_s = forward_delay_s
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s)
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(seed: int = 0, **kwargs) -> TinyGPT:
    """Model factory: the same seed gives the same initial weights on every rank."""
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross entropy, mean over the micro-batch."""
    tokens = batch["tokens"].long()  # parquet token columns are often int32
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def input_schema(seq_len: int = 32, **_) -> dict[str, tuple[str, tuple]]:
    """What `loss` consumes: airay checks a dataset's preprocessed rows against it before a run."""
    return {"tokens": ("int", (seq_len + 1,))}


def synthetic_sample(sample_id: int, seed: int, vocab_size: int = 256, seq_len: int = 32) -> dict[str, torch.Tensor]:
    """Sample `sample_id`: a learnable sequence (an arithmetic progression mod vocab) from its own RNG.

    Depends only on (seed, sample_id), so any worker at any world size builds the same sample.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + sample_id)
    start = int(torch.randint(0, vocab_size, (1,), generator=g))
    stride = int(torch.randint(1, 8, (1,), generator=g))
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    return {"tokens": tokens, "sample_id": torch.tensor(sample_id)}
