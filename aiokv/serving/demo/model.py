"""A tiny deterministic decoder-only transformer with a paged KV cache.

It exists to show and test disaggregated serving end to end: prefill in one
process writes the prompt's KV into a paged cache, aiokv moves those blocks,
decode in another process reads them and must produce exactly the tokens a
single process would.

* weights: random, from a fixed seed on the CPU generator (the same in every
  process), then moved to the device;
* architecture: token embedding, ``num_layers`` pre-norm blocks (RMSNorm,
  multi-head attention with rotary positions and optional grouped KV heads,
  SwiGLU MLP), final RMSNorm, LM head; greedy decoding; float32;
* paged KV cache: one tensor per layer in FlashAttention layout
  ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V), a
  free-list block allocator; position ``p`` of a request lives in block
  ``block_ids[p // block_size]`` at offset ``p % block_size``.

Paged and dense attention read bit-identical K/V (the paged path gathers the
slots into a contiguous tensor, then both run the same code), so greedy
outputs match exactly. Across processes, results are reproducible on CPU with
``torch.set_num_threads(1)`` (the demo workers set it).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "BOS",
    "BlockAllocator",
    "DecodeSession",
    "ModelConfig",
    "OutOfBlocksError",
    "TinyTransformer",
    "chat_prompt",
    "detokenize",
    "tokenize",
]

BOS = 256  # prepended to every prompt; byte tokens are 0..255
_ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?'"


def tokenize(text: str) -> list[int]:
    """Toy tokenizer: ``BOS`` followed by the UTF-8 bytes of the text."""
    return [BOS, *text.encode("utf-8")]


def detokenize(tokens: Sequence[int]) -> str:
    """Toy detokenizer: one printable character per token (lossy, deterministic)."""
    return "".join(_ALPHABET[t % len(_ALPHABET)] for t in tokens)


def chat_prompt(messages: Sequence[Mapping[str, object]]) -> str:
    """Flatten OpenAI chat messages into one prompt string."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>{content or ''}\n")
    parts.append("<|assistant|>")
    return "".join(parts)


class OutOfBlocksError(RuntimeError):
    """The paged cache has no free block left for this request."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    ffn_dim: int = 256
    block_size: int = 16
    num_blocks: int = 256
    max_positions: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")
        if self.vocab_size <= BOS:
            raise ValueError(f"vocab_size must exceed {BOS} (byte tokens + BOS)")

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim


class BlockAllocator:
    """A free list of block ids; thread-safe (workers compute in a thread)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
            return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            for b in block_ids:
                if not 0 <= b < self.num_blocks:
                    raise ValueError(f"block id {b} out of range")
            self._free.extend(reversed(list(block_ids)))


class _Layer:
    def __init__(self, cfg: ModelConfig, g: torch.Generator) -> None:
        h, kvd = cfg.hidden, cfg.num_kv_heads * cfg.head_dim

        def lin(i: int, o: int) -> torch.Tensor:
            return torch.randn(i, o, generator=g) / math.sqrt(i)

        self.attn_norm = 1.0 + 0.1 * torch.randn(h, generator=g)
        self.wq = lin(h, h)
        self.wk = lin(h, kvd)
        self.wv = lin(h, kvd)
        self.wo = lin(h, h)
        self.mlp_norm = 1.0 + 0.1 * torch.randn(h, generator=g)
        self.w_gate = lin(h, cfg.ffn_dim)
        self.w_up = lin(h, cfg.ffn_dim)
        self.w_down = lin(cfg.ffn_dim, h)

    def to(self, device: torch.device) -> _Layer:
        for name, t in vars(self).items():
            setattr(self, name, t.to(device))
        return self


class TinyTransformer:
    """The model, its paged KV cache and block allocator on one device."""

    def __init__(
        self, config: ModelConfig | None = None, device: str | torch.device = "cpu"
    ) -> None:
        self.config = cfg = config or ModelConfig()
        self.device = torch.device(device)
        g = torch.Generator(device="cpu").manual_seed(cfg.seed)
        self.embed = torch.randn(cfg.vocab_size, cfg.hidden, generator=g).to(self.device)
        self.layers = [_Layer(cfg, g).to(self.device) for _ in range(cfg.num_layers)]
        self.final_norm = (1.0 + 0.1 * torch.randn(cfg.hidden, generator=g)).to(self.device)
        self.lm_head = (
            torch.randn(cfg.hidden, cfg.vocab_size, generator=g) / math.sqrt(cfg.hidden)
        ).to(self.device)
        inv = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        )
        angles = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float64), inv)
        self._cos = angles.cos().to(torch.float32).to(self.device)
        self._sin = angles.sin().to(torch.float32).to(self.device)
        # one allocation, one contiguous view per layer (lets a connector gather all layers at once)
        self.kv_caches: list[torch.Tensor] = list(
            torch.zeros(
                cfg.num_layers,
                2,
                cfg.num_blocks,
                cfg.block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                dtype=torch.float32,
                device=self.device,
            ).unbind(0)
        )
        self.allocator = BlockAllocator(cfg.num_blocks)

    # -- building blocks -----------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.norm_eps) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]; rotate (even, odd) pairs
        cos = self._cos[pos][:, None, :]
        sin = self._sin[pos][:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        # q [T, H, D] at positions start..start+T-1; k, v [S, KVH, D] for positions 0..S-1
        cfg = self.config
        rep = cfg.num_heads // cfg.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        t, s = q.shape[0], k.shape[0]
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(cfg.head_dim)
        qpos = torch.arange(start, start + t, device=q.device)[:, None]
        kpos = torch.arange(s, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hts,shd->thd", probs, v).reshape(t, cfg.hidden)

    def _forward(self, tokens: Sequence[int], start: int, kv: _KVAccess) -> int:
        """Run ``tokens`` at positions ``start...``; return the greedy next token."""
        cfg = self.config
        if start + len(tokens) > cfg.max_positions:
            raise ValueError(f"sequence longer than max_positions={cfg.max_positions}")
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError("token id out of range")
        t = ids.shape[0]
        pos = torch.arange(start, start + t, device=self.device)
        x = self.embed[ids]
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.attn_norm)
            q = self._rope((h @ layer.wq).view(t, cfg.num_heads, cfg.head_dim), pos)
            k = self._rope((h @ layer.wk).view(t, cfg.num_kv_heads, cfg.head_dim), pos)
            v = (h @ layer.wv).view(t, cfg.num_kv_heads, cfg.head_dim)
            k_all, v_all = kv.write_and_read(i, k, v, start)
            x = x + self._attend(q, k_all, v_all, start) @ layer.wo
            h = self._rms(x, layer.mlp_norm)
            x = x + (F.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down
        logits = self._rms(x[-1], self.final_norm) @ self.lm_head
        return int(torch.argmax(logits).item())

    # -- public API ----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, tokens: Sequence[int], block_ids: Sequence[int] | None = None
    ) -> tuple[int, list[int]]:
        """Compute the prompt's KV into ``block_ids`` (the caller's, at least
        :meth:`blocks_for` the prompt) or freshly allocated blocks.

        Returns ``(first_token, block_ids)``; the caller owns the blocks (:meth:`free`).
        """
        if not tokens:
            raise ValueError("empty prompt")
        if block_ids is not None:
            if len(block_ids) < self.blocks_for(len(tokens)):
                raise ValueError(f"{len(block_ids)} blocks cannot hold {len(tokens)} tokens")
            ids = list(block_ids)
            return self._forward(tokens, 0, _PagedKV(self, ids)), ids
        ids = self.allocator.allocate(self.blocks_for(len(tokens)))
        try:
            first = self._forward(tokens, 0, _PagedKV(self, ids))
        except BaseException:
            self.allocator.free(ids)
            raise
        return first, ids

    def decode_session(
        self, block_ids: Sequence[int], num_tokens: int, first_token: int
    ) -> DecodeSession:
        """Step-wise decoding from a prefilled paged cache (see :class:`DecodeSession`)."""
        return DecodeSession(self, block_ids, num_tokens, first_token)

    def decode(
        self, block_ids: Sequence[int], num_tokens: int, first_token: int, max_tokens: int
    ) -> list[int]:
        """Greedy tokens ``[first_token, ...]`` (``max_tokens`` of them) from the paged cache.

        ``block_ids`` hold the KV of ``num_tokens`` prompt positions. Blocks
        needed beyond them are allocated here and freed on return.
        """
        with self.decode_session(block_ids, num_tokens, first_token) as s:
            return [s.step() for _ in range(max_tokens)]

    @torch.inference_mode()
    def generate(self, prompt_tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Single-process reference: greedy generation with a dense, unpaged KV cache."""
        dense = _DenseKV(self.config.num_layers)
        tok = self._forward(prompt_tokens, 0, dense)
        out = [tok]
        pos = len(prompt_tokens)
        while len(out) < max_tokens:
            tok = self._forward([tok], pos, dense)
            out.append(tok)
            pos += 1
        return out[:max_tokens]

    def free(self, block_ids: Sequence[int]) -> None:
        self.allocator.free(block_ids)


class DecodeSession:
    """Greedy decoding one token per :meth:`step`; the first step returns ``first_token``.

    Extra blocks are allocated as the sequence grows and freed by :meth:`close`
    (also on ``with`` exit); the caller's ``block_ids`` stay the caller's.
    """

    def __init__(
        self, model: TinyTransformer, block_ids: Sequence[int], num_tokens: int, first_token: int
    ) -> None:
        if num_tokens < 1 or model.blocks_for(num_tokens) > len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens")
        if not 0 <= first_token < model.config.vocab_size:
            raise ValueError("first_token out of range")
        self._model = model
        self._blocks = list(block_ids)
        self._own: list[int] = []
        self._pos = num_tokens  # position of the next token to feed
        self._next = first_token
        self._emitted = 0

    @torch.inference_mode()
    def step(self) -> int:
        if self._emitted == 0:
            self._emitted = 1
            return self._next
        m = self._model
        if self._pos // m.config.block_size >= len(self._blocks):
            new = m.allocator.allocate(1)
            self._own.extend(new)
            self._blocks.extend(new)
        self._next = m._forward([self._next], self._pos, _PagedKV(m, self._blocks))
        self._pos += 1
        self._emitted += 1
        return self._next

    def close(self) -> None:
        if self._own:
            self._model.allocator.free(self._own)
            self._own = []

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _KVAccess:
    def write_and_read(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class _DenseKV(_KVAccess):
    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def write_and_read(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pk, pv = self.k[layer], self.v[layer]
        if pk is None or pv is None:
            assert start == 0
            nk, nv = k.clone(), v.clone()
        else:
            assert pk.shape[0] == start
            nk, nv = torch.cat([pk, k]), torch.cat([pv, v])
        self.k[layer], self.v[layer] = nk, nv
        return nk, nv


class _PagedKV(_KVAccess):
    def __init__(self, model: TinyTransformer, block_ids: Sequence[int]) -> None:
        self.model = model
        self.blocks = torch.tensor(list(block_ids), dtype=torch.long, device=model.device)

    def write_and_read(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.model.config.block_size
        cache = self.model.kv_caches[layer]
        end = start + k.shape[0]
        pos = torch.arange(0, end, device=k.device)
        blk, off = self.blocks[pos // bs], pos % bs
        cache[0, blk[start:], off[start:]] = k
        cache[1, blk[start:], off[start:]] = v
        return cache[0, blk, off], cache[1, blk, off]
