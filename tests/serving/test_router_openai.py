"""The router and demo workers through the official ``openai`` client: the OpenAI
parameters the workers honour (``stop``, ``n``, ``stream_options.include_usage``,
``seed``), the ones they refuse (400 ``unsupported_parameter``, never ignored) and
OpenAI-shaped errors for routes the router does not have."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from test_demo import demo_cluster, needs_connector

from aiokv.serving.demo.model import TinyTransformer, chat_prompt, detokenize, tokenize
from aiokv.serving.demo.worker import DEFAULT_MODEL_NAME

pytestmark = [needs_connector, pytest.mark.anyio]

PROMPT = "Stop sequences, through the router."
MESSAGES: list[Any] = [{"role": "user", "content": "say something"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _greedy(tokens: list[int], n: int) -> str:
    return detokenize(TinyTransformer().generate(tokens, n))


def _stop_in(text: str) -> tuple[str, str]:
    """A stop string found in ``text`` past its start, and the text before it."""
    for i in range(3, len(text) - 2):
        stop = text[i : i + 2]
        if text.find(stop) >= 2:
            return stop, text[: text.find(stop)]
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.timeout(120)
async def test_stop_n_and_usage_through_the_openai_client() -> None:
    full = _greedy(tokenize(PROMPT), 12)
    stop, before = _stop_in(full)
    async with demo_cluster() as http:
        client = openai.AsyncOpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused")
        async with client:
            r = await client.completions.create(
                model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=12, stop=[stop], n=2, seed=7
            )
            assert [c.text for c in r.choices] == [before, before]
            assert [c.index for c in r.choices] == [0, 1]
            assert all(c.finish_reason == "stop" for c in r.choices)
            assert r.usage is not None and r.usage.prompt_tokens == len(tokenize(PROMPT))

            r = await client.completions.create(
                model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0
            )
            assert r.choices[0].text == full and r.choices[0].finish_reason == "length"

            stream = await client.completions.create(
                model=DEFAULT_MODEL_NAME,
                prompt=PROMPT,
                max_tokens=12,
                stop=stop,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == before
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
            assert all(c.usage is None for c in chunks[:-1])
            usage = chunks[-1].usage
            assert chunks[-1].choices == [] and usage is not None
            assert usage.prompt_tokens == len(tokenize(PROMPT))
            assert 0 < usage.completion_tokens < 12  # the stop ended decoding early

            chat_full = _greedy(tokenize(chat_prompt(MESSAGES)), 6)
            cstream = await client.chat.completions.create(
                model=DEFAULT_MODEL_NAME,
                messages=MESSAGES,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
            cchunks = [c async for c in cstream]
            assert "".join(c.choices[0].delta.content or "" for c in cchunks if c.choices) == (
                chat_full
            )
            assert cchunks[-1].usage is not None and cchunks[-1].usage.completion_tokens == 6


@pytest.mark.timeout(120)
async def test_parameters_the_workers_cannot_honour_are_refused_not_ignored() -> None:
    refused: list[dict[str, Any]] = [
        {"temperature": 0.7},
        {"top_p": 0.5},
        {"echo": True},
        {"logprobs": 2},
        {"best_of": 3},
        {"presence_penalty": 1.0},
        {"logit_bias": {"5": 10}},
        {"suffix": "tail"},
    ]
    async with demo_cluster() as http:
        client = openai.AsyncOpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused")
        async with client:
            for extra in refused:
                with pytest.raises(openai.BadRequestError) as exc:
                    await client.completions.create(
                        model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=2, **extra
                    )
                assert exc.value.code == "unsupported_parameter", (extra, exc.value.body)
                assert next(iter(extra)) in exc.value.message
            for extra in ({"temperature": 0.2}, {"logprobs": True}, {"top_logprobs": 3}):
                with pytest.raises(openai.BadRequestError) as exc:
                    await client.chat.completions.create(
                        model=DEFAULT_MODEL_NAME, messages=MESSAGES, max_tokens=2, **extra
                    )
                assert exc.value.code == "unsupported_parameter", (extra, exc.value.body)
            # stream_options without a stream is a client error, said so
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(
                    model=DEFAULT_MODEL_NAME,
                    prompt=PROMPT,
                    max_tokens=2,
                    stream_options={"include_usage": True},
                )
            # a route the router does not have: OpenAI's error shape, which the client reads
            with pytest.raises(openai.NotFoundError) as nf:
                await client.embeddings.create(model=DEFAULT_MODEL_NAME, input="x")
            assert nf.value.code == "not_found"
