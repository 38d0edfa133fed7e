"""Experiment (branch prefill-registers), run with `python3 -m benchmarks.grouped_registers_emulation`.
Block-level emulation of grouped_registers' addressing (float math, no rounding): the shared
memory stages filled exactly as its cp.async copies do, each lane's reads and operands, the
m16n8k16 products, and the epilogue's writes, for every block of a small problem; compared with
the dequantised product. Checks indexing only (not T rounding, not the pipeline's timing)."""
import numpy as np

BK, LDS, RBN, WN = 64, 72, 128, 32

def byte_perm(x, y, sel):
    b = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(b[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))

def run(bits, group, BM, gated, pairs_in, in_dim, out_dim, experts, top_k, tokens, rng):
    M = 2 if gated else 1
    WM = BM if BM < 64 else 64; WARPS_M = BM // WM; MI = WM // 16; THREADS = WARPS_M * 4 * 32
    W_ROW_BYTES = BK * bits // 8; W_STAGE_BYTES = RBN * W_ROW_BYTES
    A_CHUNKS = BM * BK // 8 // THREADS; W_CHUNKS = W_STAGE_BYTES // 16 // THREADS; WORDS = 16 * bits // 32
    pairs = tokens * top_k
    idx = rng.integers(0, experts, size=pairs)
    # routing (as route_reference): runs padded to BM
    counts = np.bincount(idx, minlength=experts); padded = (counts + BM - 1) // BM * BM
    starts = np.concatenate([[0], np.cumsum(padded)])
    tiles = pairs // BM + experts
    row_pair = -np.ones(tiles * BM, dtype=np.int64); cursor = starts[:-1].copy()
    for p in range(pairs):
        e = idx[p]; row_pair[cursor[e]] = p; cursor[e] += 1
    tile_expert = np.array([np.searchsorted(starts, t * BM, side="right") - 1 if t * BM < starts[-1] else -1 for t in range(tiles)])
    # inputs
    x = rng.integers(-4, 5, size=(tokens if pairs_in else tiles * BM, in_dim)).astype(np.float64)
    q = [rng.integers(0, 2 ** bits, size=(experts, out_dim, in_dim)) for _ in range(M)]
    sc = [rng.integers(1, 4, size=(experts, out_dim, in_dim // group)).astype(np.float64) for _ in range(M)]
    bi = [rng.integers(-3, 3, size=(experts, out_dim, in_dim // group)).astype(np.float64) for _ in range(M)]
    per_word = 32 // bits
    packed = []
    for m in range(M):
        w = np.zeros((experts, out_dim, in_dim // per_word), dtype=np.uint64)
        for k in range(in_dim):
            w[:, :, k // per_word] |= q[m][:, :, k].astype(np.uint64) << np.uint64(bits * (k % per_word))
        packed.append(w.astype(np.uint32).tobytes())  # little-endian bytes, row-major
    row_bytes = in_dim * bits // 8
    out = {}
    for tile in range(tiles):
        expert = tile_expert[tile]
        if expert < 0:
            continue
        for bx in range((out_dim + RBN - 1) // RBN):
            n0 = bx * RBN
            acc = np.zeros((M, WARPS_M * 4, 32, MI, WN // 8, 4))
            for step in range(in_dim // BK):
                k0 = step * BK
                sa = np.zeros((BM, LDS))
                sw = [bytearray(W_STAGE_BYTES) for _ in range(M)]
                for tid in range(THREADS):
                    a_chunk = tid % (BK // 8)
                    for i in range(A_CHUNKS):
                        r = (tid + i * THREADS) // (BK // 8)
                        pair = row_pair[tile * BM + r]
                        src_row = (pair // top_k if pair >= 0 else 0) if pairs_in else tile * BM + r
                        if pair >= 0:
                            sa[r, a_chunk * 8:a_chunk * 8 + 8] = x[src_row, k0 + a_chunk * 8:k0 + a_chunk * 8 + 8]
                    for m in range(M):
                        for i in range(W_CHUNKS):
                            c = tid + i * THREADS
                            n = n0 + c // (W_ROW_BYTES // 16)
                            off = (expert * out_dim + (n if n < out_dim else 0)) * row_bytes + c % (W_ROW_BYTES // 16) * 16 + k0 * bits // 8
                            sw[m][c * 16:c * 16 + 16] = packed[m][off:off + 16] if n < out_dim else bytes(16)
                for warp in range(WARPS_M * 4):
                    wm, wn = divmod(warp, 4)
                    A_log = {}; B_log = {}
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        for m in range(M):
                            for j in range(WN // 8):
                                n = n0 + wn * WN + 8 * j + g
                                at_n = n if n < out_dim else 0
                                s_ = sc[m][expert, at_n, (k0 + 16 * t) // group]; b_ = bi[m][expert, at_n, (k0 + 16 * t) // group]
                                for half in range(2):
                                    base = (wn * WN + g) * W_ROW_BYTES + t * WORDS * 4 + 8 * j * W_ROW_BYTES + half * WORDS * 2
                                    ws = [int.from_bytes(sw[m][base + 4 * u:base + 4 * u + 4], "little") for u in range(WORDS // 2)]
                                    for s in range(2):
                                        word = ws[0] if bits == 4 else ws[s % (WORDS // 2)]
                                        shift = 8 * s if bits == 4 else 0
                                        mask = 0x000F000F if bits == 4 else 0x00FF00FF
                                        for sh, koff in ((shift, 0), (shift + bits, 8)):
                                            v = (word >> sh) & mask
                                            B_log[(m, j, half, s, 2 * t + koff, g)] = s_ * (v & 0xFFFF) + b_
                                            B_log[(m, j, half, s, 2 * t + koff + 1, g)] = s_ * (v >> 16) + b_
                        for mi in range(MI):
                            row = wm * WM + mi * 16 + g
                            for half in range(2):
                                for rr, roff in ((row, 0), (row + 8, 8)):
                                    e = sa[rr, 16 * t + 8 * half:16 * t + 8 * half + 8]
                                    for s in range(2):
                                        if bits == 4:
                                            lo, hi = (e[2 * s], e[2 * s + 4]), (e[2 * s + 1], e[2 * s + 5])
                                        else:
                                            lo, hi = (e[4 * s], e[4 * s + 2]), (e[4 * s + 1], e[4 * s + 3])
                                        A_log[(mi, half, s, g + roff, 2 * t)] = lo[0]; A_log[(mi, half, s, g + roff, 2 * t + 1)] = lo[1]
                                        A_log[(mi, half, s, g + roff, 2 * t + 8)] = hi[0]; A_log[(mi, half, s, g + roff, 2 * t + 9)] = hi[1]
                    for m in range(M):
                        for mi in range(MI):
                            for j in range(WN // 8):
                                for half in range(2):
                                    for s in range(2):
                                        Am = np.array([[A_log[(mi, half, s, r, k)] for k in range(16)] for r in range(16)])
                                        Bm = np.array([[B_log[(m, j, half, s, k, c)] for c in range(8)] for k in range(16)])
                                        D = Am @ Bm
                                        for lane in range(32):
                                            g, t = divmod(lane, 4)
                                            acc[m, warp, lane, mi, j] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
            for warp in range(WARPS_M * 4):
                wm, wn = divmod(warp, 4)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    for mi in range(MI):
                        for half in range(2):
                            r = wm * WM + mi * 16 + g + half * 8
                            pair = row_pair[tile * BM + r]
                            if pair < 0:
                                continue
                            for ni in range(WN // 8):
                                for jj in range(2):
                                    n = n0 + wn * WN + ni * 8 + 2 * t + jj
                                    if n >= out_dim:
                                        continue
                                    vals = tuple(acc[m, warp, lane, mi, ni, half * 2 + jj] for m in range(M))
                                    key = (tile * BM + r) if gated else pair
                                    out[(key, n)] = vals
    # check
    deq = [sc[m].repeat(group, axis=2) * q[m] + bi[m].repeat(group, axis=2) for m in range(M)]
    checked = 0
    for (key, n), vals in out.items():
        pair = row_pair[key] if gated else key
        row = x[pair // top_k] if pairs_in else x[key if gated else np.nonzero(row_pair == pair)[0][0]]
        for m in range(M):
            assert vals[m] == row @ deq[m][idx[pair], n], (key, n, m)
        checked += 1
    assert checked == pairs * out_dim, (checked, pairs * out_dim)
    return checked

rng = np.random.default_rng(1)
for cfg in [(4, 64, 64, True, True, 128, 160, 3, 2, 20), (8, 32, 32, False, False, 64, 96, 2, 2, 9),
            (4, 128, 128, False, True, 128, 128, 2, 1, 40), (8, 64, 64, True, True, 64, 256, 4, 2, 30)]:
    print(cfg, run(*cfg, rng=rng))
