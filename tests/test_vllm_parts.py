"""The parts of aiokv.vllm that need no vLLM: the extra-config migration, the
cache-layout mapping, the kv_transfer_params checks, the loop thread, the CPU
attention layout on the wire -- and that nothing else in aiokv imports vLLM.
(The connector inside real vLLM engines: tests/vllm, ``nox -s vllm``.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from aiokv import ConfigError, Engine, LayoutMismatchError
from aiokv.kv import (
    CPUAttentionLayout,
    FlashInferLayout,
    KVConnector,
    MLALayout,
    check_compatible,
    layout_from_wire,
)
from aiokv.vllm._layout import describe_caches
from aiokv.vllm._loop import LoopThread
from aiokv.vllm._protocol import batch_wire_id, decode_address_of, parse_remote, transfer_key
from aiokv.vllm._settings import MIGRATED, UNSUPPORTED, parse_settings

REPO = Path(__file__).resolve().parents[1]

# -------------------------------------------------------------------- extra config


@pytest.mark.parametrize(
    ("send_type", "mode"), [("GET", "pull"), ("PUT", "push"), ("PUT_ASYNC", "push")]
)
def test_p2p_nccl_send_type_maps_onto_the_mode(send_type: str, mode: str) -> None:
    s, warnings = parse_settings({"send_type": send_type})
    assert s.mode == mode and warnings == []


def test_p2p_nccl_keys_that_still_mean_something_are_read() -> None:
    s, warnings = parse_settings({"nccl_num_channels": "16", "mem_pool_size_gb": 4})
    assert s.nccl_max_channels == 16 and s.store_bytes == 4 << 30
    assert warnings == []
    assert set(MIGRATED) == {"send_type", "nccl_num_channels", "mem_pool_size_gb"}


def test_the_others_and_unknown_keys_warn() -> None:
    s, warnings = parse_settings(
        {"proxy_ip": "10.0.0.1", "proxy_port": "30001", "http_port": 8000, "colour": "red"}
    )
    assert s == parse_settings({})[0]
    assert len(warnings) == 4
    assert any("proxy_ip" in w and "aiokv router --prefill" in w for w in warnings)
    assert any("'colour'" in w and "not an AiokvConnector key" in w for w in warnings)
    assert set(UNSUPPORTED) >= {"proxy_ip", "proxy_port", "http_port"}


@pytest.mark.parametrize(
    "extra",
    [
        {"send_type": "SEND"},
        {"send_type": "GET", "mode": "push"},
        {"mode": "both"},
        {"listen": "nohost"},
        {"listen": "127.0.0.1:99999"},
        {"timeout": "soon"},
        {"timeout": 0},
        {"timeout": float("nan")},
        {"nccl_num_channels": 2.5},
        {"store_gb": 1, "mem_pool_size_gb": 2},
        {"advertise_host": "a b"},
        {"layerwise": "yes"},
    ],
)
def test_unusable_values_are_refused(extra: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        parse_settings(extra)


def test_listen_ports_per_rank_and_the_advertised_address() -> None:
    s, _ = parse_settings({"listen": "0.0.0.0:15000", "advertise_host": "10.1.2.3"})
    assert s.address_for(0) == "0.0.0.0:15000" and s.address_for(3) == "0.0.0.0:15003"
    assert s.advertised("0.0.0.0:15003", 3) == "10.1.2.3:15003"
    free, _ = parse_settings({})
    assert free.address_for(5) == "127.0.0.1:0"
    wild, _ = parse_settings({"listen": "0.0.0.0:0"})
    with pytest.raises(ConfigError, match="advertise_host"):
        wild.advertised("0.0.0.0:4444", 0)


# -------------------------------------------------------------------- cache layouts


def cpu_caches(n_layers: int = 3, blocks: int = 10) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.attn": torch.zeros(blocks, 2, 32, 2 * 64) for i in range(n_layers)}


def test_the_cpu_backend_cache_maps_to_cpu_attention() -> None:
    caches = cpu_caches()
    layout, tensors, names = describe_caches(
        caches, layout_name="LBHNC", block_size=32, num_kv_heads=2, head_dim=64
    )
    assert layout == CPUAttentionLayout(3, 10, 32, 2, 64, "float32")
    assert names == list(caches) and all(a is b for a, b in zip(tensors, caches.values()))
    assert layout.layer_shape() == (10, 2, 32, 128) and layout.block_dim == 0


@pytest.mark.parametrize(
    ("layout_name", "match"),
    [
        ("LBNHC", "does not know"),  # FlashAttention's, on a CPU tensor
        ("BHLNC", "does not know"),
        (None, "does not know"),
    ],
)
def test_an_unknown_layout_is_refused_by_name(layout_name: str | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        describe_caches(
            cpu_caches(), layout_name=layout_name, block_size=32, num_kv_heads=2, head_dim=64
        )
    assert str(layout_name) in str(e.value) and "known:" in str(e.value)


def test_a_cache_that_does_not_match_its_layout_is_refused() -> None:
    with pytest.raises(ConfigError, match="does not match"):
        describe_caches(
            cpu_caches(), layout_name="LBHNC", block_size=16, num_kv_heads=2, head_dim=64
        )
    mixed = cpu_caches()
    mixed["model.layers.9.attn"] = torch.zeros(10, 2, 32, 64)
    with pytest.raises(ConfigError, match="different geometry"):
        describe_caches(mixed, layout_name="LBHNC", block_size=32, num_kv_heads=2, head_dim=64)
    strided = {"l": torch.zeros(2, 32, 10, 128).permute(2, 0, 1, 3)}
    with pytest.raises(ConfigError, match="not contiguous"):
        describe_caches(strided, layout_name="LBHNC", block_size=32, num_kv_heads=2, head_dim=64)
    with pytest.raises(ConfigError, match="no KV caches"):
        describe_caches({}, layout_name="LBHNC", block_size=32, num_kv_heads=2, head_dim=64)


def test_mla_caches_map_to_mla() -> None:
    caches = {"a": torch.zeros(8, 32, 576, dtype=torch.bfloat16)}
    layout, _, _ = describe_caches(
        caches, layout_name="LBNHC", block_size=32, num_kv_heads=1, head_dim=576, use_mla=True
    )
    assert layout == MLALayout(1, 8, 32, 576, "bfloat16")


def test_cpu_attention_crosses_the_wire_and_never_matches_flashinfer() -> None:
    lay = CPUAttentionLayout(2, 10, 32, 2, 64, "float32")
    assert layout_from_wire(lay.to_wire()) == lay
    same_bytes = FlashInferLayout(2, 10, 32, 2, 64, "float32")
    assert lay.block_nbytes() == same_bytes.block_nbytes()
    with pytest.raises(LayoutMismatchError, match="kind"):
        check_compatible(lay, same_bytes)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_cpu_attention_blocks_move_through_pull_bit_exact() -> None:
    lay = CPUAttentionLayout(2, 12, 32, 1, 32, "float32")
    src = [torch.randn(lay.layer_shape()) for _ in range(2)]
    dst = [torch.zeros(lay.layer_shape()) for _ in range(2)]
    async with Engine(layout=lay.to_wire()) as pe, Engine(layout=lay.to_wire()) as de:
        prod, cons = KVConnector(pe, lay, src), KVConnector(de, lay, dst)
        serve = asyncio.ensure_future(prod.serve_request("r@x", [3, 7, 1]))
        await cons.fetch_request("r@x", [0, 5, 11], frm=pe.address, timeout=10)
        await serve
    for s, d in zip(src, dst):
        assert torch.equal(d[[0, 5, 11]], s[[3, 7, 1]])
        assert not d[[1, 2, 3, 4, 6, 7, 8, 9, 10]].any()


# -------------------------------------------------------------------- kv_transfer_params


def good(n: int = 70) -> dict[str, object]:
    return {
        "do_remote_prefill": True,
        "remote_request_id": "p-1",
        "remote_block_ids": [4, 5, 6],
        "remote_num_tokens": n,
        "aiokv": 1,
        "aiokv_mode": "pull",
        "aiokv_addresses": ["127.0.0.1:4000"],
    }


def test_parse_remote_takes_usable_params_and_says_why_not() -> None:
    r, why = parse_remote(good(), prompt_len=70, block_size=32, tp_size=1)
    assert why is None and r is not None
    assert (r.request_id, r.block_ids, r.num_tokens, r.mode) == ("p-1", (4, 5, 6), 70, "pull")
    assert r.layerwise is False
    push = good() | {"aiokv_mode": "push", "aiokv_layerwise": True}
    r, why = parse_remote(push, prompt_len=70, block_size=32, tp_size=1)
    assert why is None and r is not None and (r.mode, r.layerwise) == ("push", True)
    assert parse_settings({})[0].layerwise is True
    assert parse_settings({"layerwise": False})[0].layerwise is False
    assert parse_remote(None, prompt_len=70, block_size=32, tp_size=1) == (None, None)
    assert parse_remote({"do_remote_decode": True}, prompt_len=70, block_size=32, tp_size=1) == (
        None,
        None,
    )
    for bad in (
        {"aiokv_addresses": ["127.0.0.1:4000", "127.0.0.1:4001"]},
        {"aiokv_addresses": ["127.0.0.1:0"]},
        {"aiokv_addresses": ["tcp://x:1"]},
        {"remote_num_tokens": 71},
        {"remote_num_tokens": True},
        {"remote_block_ids": [4, 5, -6]},
        {"remote_block_ids": [4, 5, 6, 7]},
        {"remote_request_id": ""},
        {"remote_request_id": "a@b"},
        {"remote_request_id": "x" * 300},
        {"aiokv_mode": None},
        {"aiokv": 2},
        {"aiokv_layerwise": True},  # layer by layer is a push
        {"aiokv_layerwise": 1, "aiokv_mode": "push"},
    ):
        r, why = parse_remote(good() | bad, prompt_len=70, block_size=32, tp_size=1)
        assert r is None and why, bad


def test_parse_remote_takes_a_step_batch_of_a_whole_push_only() -> None:
    w = [batch_wire_id(transfer_key(f"p-{i}", [i])) for i in range(3)]
    push = good() | {"aiokv_mode": "push", "aiokv_batch": w, "aiokv_batch_index": 2}
    r, why = parse_remote(push, prompt_len=70, block_size=32, tp_size=1)
    assert why is None and r is not None and (r.batch, r.batch_index) == (tuple(w), 2)
    r, why = parse_remote(good(), prompt_len=70, block_size=32, tp_size=1)
    assert r is not None and r.batch is None
    for bad in (
        {"aiokv_mode": "pull"},  # a pull is fetched on its own
        {"aiokv_layerwise": True},  # layer by layer is not batched
        {"aiokv_batch_index": 3},
        {"aiokv_batch_index": -1},
        {"aiokv_batch_index": True},
        {"aiokv_batch": w[:1], "aiokv_batch_index": 0},  # a batch has two or more
        {"aiokv_batch": [w[0], w[0], w[1]]},
        {"aiokv_batch": [*w[:2], "p-2@abc"]},  # not a wire id
        {"aiokv_batch": "kvb-" + "0" * 32},
        {"aiokv_batch": [w[0]] + [f"kvb-{i:032x}" for i in range(1024)]},
    ):
        r, why = parse_remote(push | bad, prompt_len=70, block_size=32, tp_size=1)
        assert r is None and why, bad


def test_the_transfer_key_names_the_tokens() -> None:
    k = transfer_key("r", [1, 2, 3])
    assert k.startswith("r@") and k == transfer_key("r", [1, 2, 3])
    assert k != transfer_key("r", [1, 2, 4]) and k != transfer_key("r", [1, 2])


def test_where_a_prefill_pushes() -> None:
    assert decode_address_of("x", {"aiokv_decode": "10.0.0.2:7000"}) == "10.0.0.2:7000"
    rid = "cmpl-___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_abc-0-1f2e3d4c"
    assert decode_address_of(rid, {}) == "10.0.0.2:22001"
    assert decode_address_of("plain", {"aiokv_decode": "nope"}) is None


# -------------------------------------------------------------------- loop thread


@pytest.mark.timeout(20)
def test_the_loop_thread_runs_calls_and_spawned_work_and_stops() -> None:
    lt = LoopThread("t")
    done: list[int] = []

    async def work(i: int) -> None:
        await asyncio.sleep(0.01)
        done.append(i)

    async def forever() -> None:
        await asyncio.sleep(3600)

    async def answer() -> int:
        return 42

    assert lt.call(answer(), 5) == 42
    lt.spawn(lambda: work(1))
    lt.spawn(forever)
    assert lt.call(asyncio.sleep(0.1, 7), 5) == 7 and done == [1]
    lt.stop(2)
    assert not lt.running


# -------------------------------------------------------------------- import hygiene

_BLOCK_VLLM = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is blocked", name=name)
sys.meta_path.insert(0, Block())
"""


@pytest.mark.timeout(60)
def test_nothing_but_the_connector_imports_vllm() -> None:
    code = _BLOCK_VLLM + textwrap.dedent(
        """
        import pkgutil, importlib, aiokv
        VLLM_MODULES = {"aiokv.vllm.connector", "aiokv.vllm._meta", "aiokv.vllm._scheduler",
                        "aiokv.vllm._worker"}
        for m in pkgutil.walk_packages(aiokv.__path__, "aiokv."):
            if m.name in VLLM_MODULES:  # the connector's modules: vLLM is imported there
                continue
            importlib.import_module(m.name)
        assert not [k for k in sys.modules if k.split(".")[0] == "vllm"]
        try:
            from aiokv.vllm import AiokvConnector
        except ImportError as e:
            assert "pip install 'aiokv[vllm]'" in str(e), e
        else:
            raise AssertionError("imported without vLLM")
        print("ok")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=50
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
