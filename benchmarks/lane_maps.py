"""The lane maps of the wgmma K2's ldmatrix / stmatrix accesses and K1's ldmatrix fragments
(recurrence.cu recurrence_wgmma's quad_offset; prepare.cu left_fragment_ldsm, right_fragments_ldsm;
2026-12-05), checked on the CPU against the 32-bit loads and 16-bit stores they replaced (the same
words in the same registers, the same elements at the same addresses), from the PTX ISA's
definitions of ldmatrix and stmatrix: ``python benchmarks/lane_maps.py``. (A model of a pipeline
without a producer warp, which lost on the GPU, was beside it in 0f49635: baf32fe, benchmarks/NOTES.md.)
"""


def quad_offset(lane: int) -> int:
    """recurrence.cu's quad_offset: the row lane l addresses in a [16, 16] 16-bit tile (32 B a row)."""
    return ((lane // 16) * 8 + lane % 8) * 32 + ((lane // 8) % 2) * 16


def check_lane_maps() -> None:
    # ldmatrix (non-trans) x4: lane t gets, in register m, word t % 4 of row t // 4 of matrix m,
    # whose row j is at the address lane 8 m + j gave.
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for m in range(4):
            nt, j = m // 2, m % 2  # register 2 nt + j: b_j of n-tile nt
            got = quad_offset(8 * m + g) + 4 * t
            want = 4 * ((8 * nt + g) * 8 + t + 4 * j)  # the current step's word index, 8 words a row
            assert got == want, (lane, m, got, want)
    # stmatrix .trans x4: lane t holds in register m the fragment elements (t // 4, 2 (t % 4) + e);
    # .trans stores element (r, c) at row c of matrix m (the address of lane 8 m + c), column r.
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for m in range(4):
            nt, half = m // 2, m % 2  # register m = pack(O[nt][2 half], O[nt][2 half + 1])
            for e2 in range(2):
                e = 2 * half + e2
                got = quad_offset(8 * m + 2 * t + e2) + 2 * g
                want = 2 * ((8 * nt + 2 * t + e % 2) * 16 + g + 8 * (e // 2))
                assert got == want, (lane, m, e2, got, want)
    assert all(quad_offset(lane) % 16 == 0 for lane in range(32)), "ldmatrix rows are 16-byte aligned"
    # K1's fragments (prepare.cu left_fragment_ldsm, right_fragments_ldsm): float32 tiles read as
    # 16-bit pairs, so lane t of an 8x8 matrix gets 32-bit word t % 4 of row t // 4 (columns of
    # floats); lane l gives the address of row l % 8 of matrix l // 8: (row, first column).
    for lane in range(32):
        g, t = lane // 4, lane % 4
        left = {m: (8 * ((ln // 8) % 2) + ln % 8, 4 * (ln // 16)) for m in range(4) for ln in [8 * m + g]}
        right = {m: (8 * (ln // 16) + ln % 8, 4 * ((ln // 8) % 2)) for m in range(4) for ln in [8 * m + g]}
        want_left = [(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)]  # left_fragment's a[0..3]
        want_right = [(g, t), (g, t + 4), (8 + g, t), (8 + g, t + 4)]  # b[half][j]: row 8 half + g, column t + 4 j
        for m in range(4):
            assert (left[m][0], left[m][1] + t) == want_left[m], (lane, m)
            assert (right[m][0], right[m][1] + t) == want_right[m], (lane, m)


if __name__ == "__main__":
    check_lane_maps()
    print("lane maps: ldmatrix and stmatrix match the 32-bit loads and 16-bit stores they replaced")
