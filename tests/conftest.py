import os

# The suite checks the patched layers everywhere: where no kernel of ours is on (the CPU) that is
# through the references, which apply() leaves out unless asked (test_patches checks the default).
os.environ.setdefault("MLX_MOE_FIX_REFERENCES", "1")

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

import mlx_moe_fix  # noqa: E402
from mlx_moe_fix import env  # noqa: E402
from mlx_moe_fix.patches import compiled  # noqa: E402


def gpu_available() -> bool:
    return mx.cuda.is_available() or mx.metal.is_available()


NO_GPU = "no GPU: MLX reports neither CUDA nor Metal on this machine"


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
    """Runs a test on the CPU and, where one exists, on the GPU (skipped visibly elsewhere)."""
    if request.param == "gpu" and not gpu_available():
        pytest.skip(NO_GPU)
    previous = mx.default_device()
    mx.set_default_device(mx.cpu if request.param == "cpu" else mx.gpu)
    yield request.param
    mx.set_default_device(previous)


@pytest.fixture
def cpu_device():
    """Runs a test on the CPU wherever it runs (its checks are exact, as the references allow)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)


@pytest.fixture
def cuda_device():
    """Runs a test on a CUDA GPU; skipped visibly elsewhere."""
    if not mx.cuda.is_available():
        pytest.skip("no CUDA: MLX reports no CUDA GPU on this machine")
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(previous)


def switch_cuda_kernels_on(monkeypatch) -> None:
    """Our three CUDA kernels (prefill, decode, router) switched on for a test, whatever the
    environment says: gpu-check.sh's REFERENCES_TOO run sets them to 0 there, which a test of what
    the kernels do must override."""
    for name in ("MLX_MOE_FIX_CUDA_DECODE", "MLX_MOE_FIX_CUDA_PREFILL", "MLX_MOE_FIX_CUDA_ROUTER"):
        monkeypatch.setenv(name, "1")
    env.refresh()


@pytest.fixture
def cuda_kernels(cuda_device, monkeypatch):
    """Runs a test of our CUDA kernels on a CUDA GPU with them switched on
    (switch_cuda_kernels_on); skipped visibly elsewhere."""
    switch_cuda_kernels_on(monkeypatch)
    yield
    monkeypatch.undo()
    env.refresh()


@pytest.fixture
def switch(monkeypatch):
    """switch(name, value): sets one of env.SWITCHES for the test ("" for its default) and
    refreshes the package's reading of them; they are read afresh after the test."""

    def set_switch(name: str, value: str):
        monkeypatch.setenv(name, value)
        env.refresh()

    yield set_switch
    monkeypatch.undo()
    env.refresh()


@pytest.fixture
def metal_device(switch):
    """Runs a test on a Metal GPU with the Metal decode kernel switched on (it is off by default
    until it has run on Apple hardware); skipped visibly elsewhere."""
    if not mx.metal.is_available():
        pytest.skip("no Metal: MLX reports no Metal GPU on this machine (the Metal kernels are untested here)")
    switch("MLX_MOE_FIX_METAL_DECODE", "1")
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(previous)


@pytest.fixture(autouse=True)
def unpatched():
    """Every test starts and ends with nothing patched, no counted paths and no compiled steps
    shared by layers (a trace made under one test's stand-in implementation must not be replayed
    by another test's layers of the same structure: the steps' keys hold the switches, not the
    implementations a test swaps in)."""
    mlx_moe_fix.revert()
    mlx_moe_fix.reset_path_counts()
    compiled.forget_shared_steps()
    yield
    mlx_moe_fix.revert()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """MLX_MOE_FIX_SHARD=i/n keeps every n-th selected test from the i-th (0-based), so that
    scripts/gpu-check.sh can run n pytest processes side by side: the GPU tests mostly wait on
    MLX compiling kernels per shape, which runs on the host's CPU cores."""
    shard = os.environ.get("MLX_MOE_FIX_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"MLX_MOE_FIX_SHARD={shard}: want i/n with 0 <= i < n")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
    items[:] = items[index::count]


def pytest_addoption(parser):
    parser.addoption("--decode-block-shapes", default="", metavar="STAGE=WxRxN,...",
                     help="run with these decode block shapes (benchmarks/block_shapes.py) instead of production's: "
                          "a candidate's parity before it is adopted; the launcher tests that pin production's fail")


@pytest.fixture(autouse=True, scope="session")
def decode_block_shapes(request):
    """--decode-block-shapes set on moe_decode for the whole run (launch plans are made at first use)."""
    from benchmarks import block_shapes

    shapes = block_shapes.parse(request.config.getoption("--decode-block-shapes"))
    with block_shapes.block_shapes(shapes):
        yield shapes


def pytest_report_header(config):
    text = config.getoption("--decode-block-shapes")
    return f"decode block shapes: {text}" if text else None


def kernel_cache_report(config) -> tuple[int, list]:
    """This process's kernel-cache fills (how many variants written, the failures), plus those
    that pytest-xdist's workers reported (pytest_testnodedown), where the tests ran in them."""
    from mlx_moe_fix.kernels import kernel_cache

    written, failures = getattr(config, "worker_kernel_cache", (0, []))
    return written + len(kernel_cache.written), failures + kernel_cache.failures


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the report to the controller
        session.config.workeroutput["kernel_cache"] = kernel_cache_report(session.config)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without pytest-xdist
def pytest_testnodedown(node, error):
    """xdist's controller: add a finished worker's kernel-cache report to its own."""
    written, failures = getattr(node, "workeroutput", {}).get("kernel_cache", (0, []))  # none from a crashed worker
    so_far_written, so_far_failures = getattr(node.config, "worker_kernel_cache", (0, []))
    node.config.worker_kernel_cache = (so_far_written + written, so_far_failures + list(failures))


def pytest_terminal_summary(terminalreporter):
    """Where the kernel cache (MLX_MOE_FIX_KERNEL_CACHE) filled MLX's PTX cache: how many variants
    it wrote and which it left to MLX's own compile (a GPU run's proof that the fill worked)."""
    written, failures = kernel_cache_report(terminalreporter.config)
    if written or failures:
        terminalreporter.write_line(f"kernel cache: {written} variants written, {len(failures)} left to MLX's compile")
        for failure in failures:
            terminalreporter.write_line(f"  {failure[:400]}")
