"""The demo model: paged KV cache equals dense, and KV moved between instances decodes identically."""

from __future__ import annotations

import pytest
import torch

from aiokv.serving.demo.model import (
    BOS,
    BlockAllocator,
    ModelConfig,
    OutOfBlocksError,
    TinyTransformer,
    chat_prompt,
    detokenize,
    tokenize,
)

pytestmark = pytest.mark.timeout(60)

PROMPTS = ["", "hello", "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_tokenizer() -> None:
    assert tokenize("ab") == [BOS, 97, 98]
    assert tokenize("é")[1:] == list("é".encode())
    assert detokenize([0, 1, 2]) == "abc" and len(detokenize([300, 511])) == 2
    assert "<|user|>hi" in chat_prompt([{"role": "user", "content": "hi"}])


def test_allocator() -> None:
    a = BlockAllocator(4)
    x = a.allocate(3)
    assert x == [0, 1, 2] and a.num_free == 1
    with pytest.raises(OutOfBlocksError):
        a.allocate(2)
    a.free(x)
    assert a.num_free == 4
    with pytest.raises(ValueError):
        a.free([9])


def test_weights_deterministic() -> None:
    a, b = TinyTransformer(), TinyTransformer()
    assert torch.equal(a.embed, b.embed) and torch.equal(a.layers[3].w_down, b.layers[3].w_down)
    c = TinyTransformer(ModelConfig(seed=7))
    assert not torch.equal(a.embed, c.embed)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_paged_equals_dense(prompt: str) -> None:
    m = TinyTransformer(ModelConfig(block_size=4, num_blocks=64))
    toks = tokenize(prompt)
    ref = m.generate(toks, 12)
    # occupy a few blocks so the request's blocks are not 0..n
    hold = m.allocator.allocate(5)
    first, blocks = m.prefill(toks)
    assert blocks[0] == 5 and len(blocks) == m.blocks_for(len(toks))
    free_before = m.allocator.num_free
    out = m.decode(blocks, len(toks), first, 12)
    assert m.allocator.num_free == free_before  # decode's own blocks returned
    assert out == ref and len(out) == 12
    assert first == ref[0]
    m.free(blocks)
    m.free(hold)
    assert m.allocator.num_free == 64


def test_outputs_not_degenerate() -> None:
    m = TinyTransformer()
    outs = {tuple(m.generate(tokenize(p), 8)) for p in ["a", "b", "hello world", "xyz"]}
    assert len(outs) > 1


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_blocks_copied_to_another_instance_decode_identically(kv_heads: int) -> None:
    cfg = ModelConfig(num_kv_heads=kv_heads, block_size=8, num_blocks=32)
    producer, consumer = TinyTransformer(cfg), TinyTransformer(cfg)
    consumer.allocator.allocate(3)  # a different block table on the consumer
    for prompt in PROMPTS:
        toks = tokenize(prompt)
        ref = producer.generate(toks, 10)
        first, src = producer.prefill(toks)
        dst = consumer.allocator.allocate(len(src))
        assert dst != src
        for pc, cc in zip(producer.kv_caches, consumer.kv_caches, strict=True):
            assert pc.shape == (2, 32, 8, kv_heads, 32)
            cc[:, dst] = pc[:, src]
        producer.free(src)
        assert consumer.decode(dst, len(toks), first, 10) == ref
        consumer.free(dst)


def test_decode_session_and_errors() -> None:
    m = TinyTransformer(ModelConfig(block_size=4, num_blocks=4))
    toks = tokenize("abcdefghij")  # 11 tokens -> 3 blocks
    first, blocks = m.prefill(toks)
    with m.decode_session(blocks, len(toks), first) as s:
        assert s.step() == first
        s.step()
        s.step()  # position 11 still fits the third block
        s.step()  # position 12 needs a fourth block
        assert m.allocator.num_free == 0
        with pytest.raises(OutOfBlocksError):
            for _ in range(4):
                s.step()
    assert m.allocator.num_free == 1
    with pytest.raises(ValueError):
        m.decode_session(blocks[:1], len(toks), first)
    with pytest.raises(ValueError):
        m.prefill([])
    with pytest.raises(ValueError):
        m.generate([9999], 1)
