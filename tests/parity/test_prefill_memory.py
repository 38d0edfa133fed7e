"""Issue 4's memory criterion ("no dequantised copy of the expert weights: peak memory stays within
stock + O(tokens x hidden)") for the CUDA prefill path, on any machine: its graph evaluated on the
CPU with each kernel replaced by a stand-in that allocates the kernel's outputs while its inputs
are alive (what MLX's cuda_kernel allocates: our kernels' only scratch is shared memory), against
stock's prefill of the same layer. Beyond stock's bytes it may take only the padding rows of the
gate+up's output, which is allocated for the grid's worst case (moe_prefill.grid_tiles: at most
tile - 1 rows for each expert with pairs, so fewer than 64 rows a pair). On a CUDA GPU the same
bound on the kernels themselves; benchmarks/prefill_memory.py measures full-size layers there."""

import sys

import mlx.core as mx
import pytest

import mlx_moe_fix.kernels  # noqa: F401  loads the op modules (their names are the dispatchers')
from benchmarks.prefill_memory import build_case, stock_and_patched_bytes

PREFILL = sys.modules["mlx_moe_fix.kernels.moe_prefill"]


class AllocatingKernel:
    """Called as a cuda_kernel object: returns zero outputs of the launch's shapes and dtypes,
    allocated in a node that holds every input, so outputs and inputs are alive together as around
    a launch."""

    def __init__(self, *unused):
        pass

    def __call__(self, *, inputs, output_shapes, output_dtypes, **unused):
        outputs = [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return mx.depends(outputs, list(inputs))


def padding_bytes(case) -> int:
    """The bytes of the gate+up output's rows that no pair can fill, in the grid's worst case."""
    pairs, experts = case.indices.size, case.experts.num_experts
    tile = PREFILL.tile_height(pairs, experts)
    return (PREFILL.grid_tiles(pairs, experts, tile) * tile - pairs) * case.experts.projections[0].output_dims * case.x.itemsize


def assert_within_stock_and_padding(case, patched):
    stock, ours = stock_and_patched_bytes(case, patched)
    padding = padding_bytes(case)
    assert ours <= stock + padding, (
        f"the prefill allocates {ours / 1e6:.2f} MB, stock {stock / 1e6:.2f} MB: more than the "
        f"{padding / 1e6:.2f} MB of the grid's padding rows over stock")
    return stock, ours


@pytest.fixture
def allocating_kernels(cpu_device, monkeypatch):
    """The CUDA path's kernels as AllocatingKernels, on the CPU."""
    monkeypatch.setattr(PREFILL, "cuda_kernel_object", AllocatingKernel)


@pytest.mark.parametrize("wgmma", [False, True], ids=["mma.sync", "wgmma"])
@pytest.mark.parametrize("shape, tokens", [("small", 128), ("small", 1024), ("small_256_experts", 16),
                                           ("small_256_experts", 64)])
def test_cuda_prefill_allocates_stocks_bytes_and_its_grids_padding_at_most(allocating_kernels, monkeypatch, wgmma,
                                                                            shape, tokens):
    monkeypatch.setattr(PREFILL, "wgmma_device", lambda: wgmma)
    case = build_case(shape, tokens)
    tile = PREFILL.tile_height(case.indices.size, case.experts.num_experts)
    assert (PREFILL.gemm_kernel(case.experts, "first", tile) == "grouped_wgmma") == (wgmma and tile == 64)
    stock, ours = assert_within_stock_and_padding(case, PREFILL.moe_prefill_kernel)
    assert ours > case.activations  # the stand-ins allocated: at least the combined output and more
    if tokens >= 128:  # where the experts' runs fill most of their tiles, under stock's bytes
        assert ours < stock


@pytest.mark.gpu
@pytest.mark.parametrize("shape, tokens", [("small", 1024), ("small_256_experts", 64)])
def test_cuda_prefill_kernels_allocate_stocks_bytes_and_their_grids_padding_at_most(cuda_kernels, shape, tokens):
    assert_within_stock_and_padding(build_case(shape, tokens), PREFILL.moe_prefill_kernel)


def test_the_memory_check_finds_a_dequantised_copy_of_the_experts(allocating_kernels):
    # at few tokens a layer's weights outweigh its activations: a bf16 copy of them shows
    case = build_case("small", 128)
    projections = [case.layer[name] for name in ("gate_proj", "up_proj", "down_proj")]

    def dequantising(x, indices, experts, weights):
        # as a kernel path that dequantised the experts to bf16 for its GEMMs would
        copies = [mx.dequantize(p.weight, p.scales, p.biases, p.group_size, p.bits).astype(mx.bfloat16)
                  for p in projections]
        return mx.depends([PREFILL.moe_prefill_kernel(x, indices, experts, weights)], copies)[0]

    with pytest.raises(AssertionError, match="padding rows over stock"):
        assert_within_stock_and_padding(case, dequantising)
