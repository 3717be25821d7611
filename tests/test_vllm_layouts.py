"""The vLLM KV layouts as real-KV sources (kvcanary_cupy.integrations.vllm_layouts), without vLLM:
a tensor laid out as vLLM 0.32's CPU backend lays out a layer, a flip in one token's bytes, and the
canary's verify naming exactly that slot."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy.integrations import vllm_layouts  # noqa: E402

BLOCKS, HEADS, B, D = 4, 2, 32, 32


def cpu_layer(dtype):
    """[blocks, heads, B, 2D]; per (block, head): K transposed [D, B], then V [B, D]."""
    torch.manual_seed(0)
    return torch.randn(BLOCKS, HEADS, B, 2 * D).to(dtype)


def element(kv, half, block, head, token, d):
    """The flat index (within its (block, head) region) of element d of ``token``'s K or V."""
    return d * B + token if half == "k" else B * D + token * D + d


def flipped_slots(kv, sources, half, block, head, token, d, mode):
    n = BLOCKS * B - 1  # slots 1 .. n hold positions 0 .. n - 1 (slot 0 is the padding slot)
    table = np.zeros((2, n), np.int32)  # req_to_token; row 0 is the padding row
    table[1] = np.arange(1, n + 1)
    canary = kc.allocate_canary_buffer(BLOCKS * B)
    log = kc.ViolationLog.allocate(64)
    _, wp = kc.plan(np.array([1]), np.array([0]), np.array([n]), table, verify_capacity=0)
    kc.write(canary, wp, np.arange(n), np.arange(n), np.arange(1, n + 1), log=log, real_kv_sources=sources,
             real_kv_hash_mode=mode)
    region = kv.view(BLOCKS, HEADS, 2 * B * D).view(torch.int16 if kv.element_size() == 2 else torch.int32)
    region[block, head, element(kv, half, block, head, token, d)] ^= 1 << 3
    vp, _ = kc.plan(np.array([1]), np.array([n]), np.array([0]), table, verify_capacity=n)
    kc.verify(canary, vp, log=log, real_kv_sources=sources, real_kv_hash_mode=mode)
    return sorted({v.slot_idx for v in log.read().violations})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL])
def test_a_flip_in_one_tokens_v_names_its_slot(dtype, mode):
    kv = cpu_layer(dtype)
    sources = vllm_layouts.layer_sources("CPU_ATTN", kv, B, D)
    # head 1's bytes lie past PARTIAL's 16 bytes in the strided stream (head 0 first): d = 0 of head 0 there
    head = 1 if mode == kc.RealKvHashMode.ALL or not vllm_layouts.has_strided_sources() else 0
    assert flipped_slots(kv, sources, "v", 2, head, 5, 0, mode) == [2 * B + 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flip_in_transposed_k_needs_a_strided_source(dtype):
    kv = cpu_layer(dtype)
    sources = vllm_layouts.layer_sources("CPU_ATTN", kv, B, D)
    got = flipped_slots(kv, sources, "k", 1, 0, 7, 0, kc.RealKvHashMode.ALL)
    assert got == ([B + 7] if vllm_layouts.has_strided_sources() else [])  # without one, K is not read at all


def test_layouts_the_adapters_do_not_cover_say_why():
    kv = cpu_layer(torch.float32)
    with pytest.raises(vllm_layouts.LayoutNotCovered, match="AMX"):
        vllm_layouts.layer_sources("CPU_ATTN", kv, B, D, isa="amx")
    with pytest.raises(vllm_layouts.LayoutNotCovered, match="attention backend MLA"):
        vllm_layouts.layer_sources("MLA", kv, B, D)
    with pytest.raises(vllm_layouts.LayoutNotCovered, match="shape"):
        vllm_layouts.layer_sources("CPU_ATTN", kv, 16, D)


def test_sources_stop_at_the_sessions_limit():
    layers = [cpu_layer(torch.float32) for _ in range(4)]
    sources, covered = vllm_layouts.sources_for("CPU_ATTN", layers, range(4), B, D)
    assert len(sources) <= kc.MAX_REAL_KV_SOURCES and covered == tuple(range(len(sources) // 2))
