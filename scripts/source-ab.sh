#!/usr/bin/env bash
# A/B of kernel sources on the GPU machine, where the copy of the tree has no git: runs COMMAND on
# the working tree ("main"), then once per alternative under .ab/NAME/ (files laid out as in the
# repo, replacing the tree's own), restoring the tree after each. Logs: $OUT/ab-NAME.log.
#
# Here (with git), write each alternative from a branch: the files it changed since it left HEAD
# (rebase it on HEAD first, or those files lose what HEAD changed in them since).
#     scripts/source-ab.sh --prepare decode-direct decode-dequant
# Then on the GPU machine (.ab/ is untracked and not ignored, so it travels with the tree):
#     source .mlx-cuda/setup.sh && source scripts/ptx-cache.sh && \
#         MLX_MOE_FIX_CUDA_DECODE=1 scripts/source-ab.sh python3 -m benchmarks.decode_split
# Kernel names carry their source's digest, so each alternative compiles its own kernels.
set -u -o pipefail
ab=.ab
if [ "${1:-}" = "--prepare" ]; then
    shift
    for branch in "$@"; do
        rm -rf "${ab:?}/$branch"
        git diff --name-only --diff-filter=AM "HEAD...$branch" -- mlx_moe_fix | while read -r path; do
            mkdir -p "$ab/$branch/$(dirname "$path")" && git show "$branch:$path" >"$ab/$branch/$path"
        done
        echo "$ab/$branch: $(find "$ab/$branch" -type f | wc -l) files"
    done
    exit 0
fi
[ $# -gt 0 ] || { echo "usage: $0 COMMAND... | $0 --prepare BRANCH..." >&2; exit 2; }
out=${OUT:-/tmp/source-ab}
mkdir -p "$out"
backup=$(mktemp -d)
failed=0
run() {  # run NAME: COMMAND on the tree as it is now
    "$@" >"$out/ab-$name.log" 2>&1 || { echo "ab $name: exit $?" >&2; failed=1; }
    echo "== $name"
    tail -n "${TAIL:-12}" "$out/ab-$name.log"
}
name=main run "$@"
for dir in "$ab"/*/; do
    [ -d "$dir" ] || continue
    name=$(basename "$dir")
    (cd "$dir" && find . -type f) | while read -r path; do
        mkdir -p "$backup/$(dirname "$path")" && cp "$path" "$backup/$path" && cp "$dir/$path" "$path"
    done
    name=$name run "$@"
    (cd "$backup" && find . -type f) | while read -r path; do cp "$backup/$path" "$path"; done
    rm -rf "${backup:?}"/*
done
rm -rf "$backup"
exit "$failed"
