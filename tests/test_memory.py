"""Host memory: huge pages for the CPU KV pool and weights, a heap that keeps freed activations."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from helpers import build_llm, greedy, model_path

from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.utils.memory import HUGE_PAGE_BYTES, advise_huge_pages, empty_on_huge_pages

THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def test_only_whole_huge_pages_are_advised():
    assert not advise_huge_pages(torch.empty(1024))  # no whole 2 MB page inside
    assert advise_huge_pages(torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8)) == THP


def test_kv_pool_starts_zeroed_and_stores_rows():
    pool = MHAKVCache(2, 70_000, 2, 16, torch.bfloat16, torch.device("cpu"))
    assert pool.k_cache(1).abs().sum() == 0 and pool.v_cache(0).abs().sum() == 0
    k = torch.randn(3, 2, 16).bfloat16()
    slots = torch.tensor([5, 69_999, 12])
    pool.store_kv(k, -k, slots, layer_id=1)
    assert torch.equal(pool.k_cache(1)[slots], k) and torch.equal(pool.v_cache(1)[slots], -k)


def test_freed_activations_are_reused_without_page_faults():
    """After keep_freed_memory(), a forward-pass-like round of large allocations reuses the heap
    instead of mapping (and zero-filling) fresh pages each time."""
    script = """
import resource, torch
from minisgl.utils.memory import keep_freed_memory
assert keep_freed_memory()
def forward_like():
    blocks = [torch.ones(6 << 20, dtype=torch.bfloat16) for _ in range(4)]  # 12 MB each
    blocks += [torch.ones(1 << 20) for _ in range(4)]  # 4 MB each
    return sum(float(b[-1]) for b in blocks)
for _ in range(3):  # the heap grows to its working size
    forward_like()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    forward_like()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    # A round maps 64 MB (16k pages of 4 KB) when it gets fresh memory; glibc's defaults refault
    # ~40k pages in these five rounds.
    assert int(result.stdout.strip()) < 16384, result.stdout


def test_an_engine_bounds_onednns_per_shape_caches():
    """After an engine starts, oneDNN matmuls at many row counts (a server's prefills of varied
    lengths) hold no more memory than its bounded caches: at oneDNN's and PyTorch's defaults
    these 200 row counts kept ~100 MB (~0.5 MB each)."""
    script = """
import ctypes, sys, torch
from minisgl.layers.linear import onednn_pack
from minisgl.llm import LLM
LLM(sys.argv[1], device="cpu", dtype=torch.float32, num_page_override=64)
class MallInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo.restype = MallInfo
weight = onednn_pack(torch.randn(256, 128))
def multiply(rows):
    torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 128), weight, None, "none", [], "")
for rows in range(1, 301):  # the caches fill
    multiply(rows)
before = mallinfo().uordblks
for rows in range(301, 501):
    multiply(rows)
print(mallinfo().uordblks - before)
"""
    result = subprocess.run(
        [sys.executable, "-c", script, str(model_path("llama3"))],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert int(result.stdout.strip().splitlines()[-1]) < 8 << 20, result.stdout


def test_tensors_on_huge_pages_lie_back_to_back():
    specs = [
        (torch.Size([300, 7]), torch.bfloat16),
        (torch.Size([5]), torch.int32),
        (torch.Size([3 << 20]), torch.float32),  # 12 MB: whole huge pages inside
        (torch.Size([1]), torch.bfloat16),
    ]
    slots = empty_on_huge_pages(specs)
    for (shape, dtype), slot in zip(specs, slots):
        assert slot.dtype == dtype and slot.shape == shape
        assert slot.is_contiguous() and slot.data_ptr() % 64 == 0
        slot.fill_(1)  # writable, and each its own memory
    assert all(bool((slot == 1).all()) for slot in slots)
    starts = [s.data_ptr() for s in slots]
    assert starts == sorted(starts) and starts[0] % HUGE_PAGE_BYTES == 0
    ends = [s.data_ptr() + s.numel() * s.element_size() for s in slots]
    assert all(end <= start < end + 64 for end, start in zip(ends, starts[1:]))  # no gaps


def test_model_weights_and_tile_copies_live_in_one_buffer():
    llm = build_llm("smollm2", dtype=torch.bfloat16, cache_type="naive")
    model = llm.engine.model
    tensors = [p for p in model.parameters() if p.numel() > 0]
    tensors += [
        m.cpu_projection.packed
        for m in model.modules()
        if getattr(m, "cpu_projection", None) is not None
        and m.cpu_projection.packed is not None
        and m.cpu_projection.packed.layout == torch.strided
    ]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(start < previous_end + 64 for (_, previous_end), (start, _) in zip(spans, spans[1:]))
    out = llm.generate(["The capital of France is"], greedy(3))[0]
    assert out["text"].startswith(" Paris")
    llm.shutdown()
