# Sourced (bash) on the GPU machine, after .mlx-cuda/setup.sh:   source scripts/ptx-cache.sh
#
# MLX keeps the CUDA kernels it JIT-compiles for its own ops (one per shape) in MLX_PTX_CACHE_DIR,
# under the kernel's name; ours as the package's kernel cache writes them there (on by default;
# MLX 0.32.4 itself compiles mx.fast.cuda_kernel's in every process: docs/benchmarks.md,
# forty-fifth and forty-sixth sessions). A fresh
# GPU machine has none, and compiling them is most of a GPU test's time (stock's first sorted
# SwitchGLU call at one Qwen3 shape: 42 s). This
# restores the cache an earlier call saved, from .mlx-ptx-cache/ in the repo root (ignored by git:
# name it in `carry`), and defines `ptx_cache_save DIR`, which packs the cache into
# DIR/mlx-ptx-cache.tar.xz.00, .01, ... (parts of at most 15 MiB: files come back from a call
# up to 16 MiB each) for the next call. Keep them, here, with
#     mkdir -p .mlx-ptx-cache && cp FILES_AT/mlx-ptx-cache.tar.xz.* .mlx-ptx-cache/
# Our kernels' names carry their sources' digest, so an edited kernel never loads an old build.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-cache}
mkdir -p "$MLX_PTX_CACHE_DIR"
if compgen -G ".mlx-ptx-cache/mlx-ptx-cache.tar.xz.*" >/dev/null; then
    cat .mlx-ptx-cache/mlx-ptx-cache.tar.xz.* | tar xJf - -C "$MLX_PTX_CACHE_DIR" &&
        echo "ptx cache: $(find "$MLX_PTX_CACHE_DIR" -type f | wc -l) files restored" >&2
    # An archive truncated on its way here (saved before ptx_cache_save packed aside, or cut in
    # transfer) restores a kernel's .ptx without its .txt (the names it holds), which fails every
    # later launch ("There is no kernel named ..."). Keep only kernels whose three files all came back.
    for ptx_cache_stem in $(find "$MLX_PTX_CACHE_DIR" -type f | sed 's/\.[a-z]*$//' | sort -u); do
        [ -s "$ptx_cache_stem.cu" ] && [ -s "$ptx_cache_stem.ptx" ] && [ -s "$ptx_cache_stem.txt" ] ||
            rm -f "$ptx_cache_stem.cu" "$ptx_cache_stem.ptx" "$ptx_cache_stem.txt"
    done
fi

# The parts are packed in DIR/ptx-cache-incomplete and moved into DIR once whole, so that a call
# killed while packing leaves no truncated archive where the next call's copy looks.
ptx_cache_save() {
    local dest=$1 packing=$1/ptx-cache-incomplete
    mkdir -p "$packing" && rm -f "$dest"/mlx-ptx-cache.tar.xz.* "$packing"/* &&
        tar cJf - -C "$MLX_PTX_CACHE_DIR" . | split -b 15M -d - "$packing/mlx-ptx-cache.tar.xz." &&
        mv "$packing"/mlx-ptx-cache.tar.xz.* "$dest"/ && rmdir "$packing" &&
        echo "ptx cache: $(find "$MLX_PTX_CACHE_DIR" -type f | wc -l) files saved in $(ls "$dest"/mlx-ptx-cache.tar.xz.* | wc -l) parts" >&2
}
