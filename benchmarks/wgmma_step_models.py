"""Models, on the CPU, of what the wgmma K2's candidate steps (recurrence.cu recurrence_wgmma's NEXT
and INLINE, and their K1, prepare.cu's kLdsm; 2026-12-05) rest on, for want of a GPU to run them:
``python benchmarks/wgmma_step_models.py``.

1. The lane maps of NEXT's ldmatrix.x4 (inverse_beta and M as mma.sync right operands) and
   stmatrix.x4.trans (the output tile) against the current step's 32-bit loads and 16-bit stores,
   and of K1's float32 fragments by ldmatrix against its 32-bit loads: the same words in the same
   registers, the same elements at the same addresses.
2. INLINE's pipeline: four warps, S stages, mbarriers with phases, pending arrivals and transaction
   bytes, cp.async and bulk copies landing at random later times, random interleavings. No
   deadlock, every read of a stage sees its chunk's data, nothing overwritten while read; and each
   seeded defect (wrong parity, a missing workspace copy, a wrong arrival count, v refilled before
   it is read) is caught.
"""

import random

STEPS = 4  # the unrolled stages at two CTAs an SM (abi.WGMMA_STAGES); six at one


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


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, tx=0):
        self.pending -= 1
        self.tx += tx
        self._check()

    def complete_tx(self, n):
        self.tx -= n
        self._check()

    def _check(self):
        assert self.pending >= 0
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity):  # try_wait.parity: the phase of that parity has completed
        return self.phase % 2 != parity


def run(n, S, seed, mutate=None):
    rng = random.Random(seed)
    W = 4
    full = [Barrier(W * 32 + (0 if mutate == "count" else 1)) for _ in range(S)]
    empty = [Barrier(W * 32) for _ in range(S)]
    v = [[None] * W for _ in range(S)]  # chunk whose v columns of warp w a stage holds
    ws = [None] * S
    reading = [[False] * W for _ in range(S)]  # warp w may still read stage s's workspace
    inflight = []  # (callback)

    def fill_v(w, c, s):
        def land():
            assert not reading_v[s][w], f"v of warp {w} overwritten while read (stage {s})"
            v[s][w] = c
            for _ in range(32):
                full[s].arrive()  # the lanes' noinc arrivals

        inflight.append(land)

    def fill_ws(c, s):
        full[s].arrive(tx=1)

        def land():
            assert not any(reading[s]), f"workspace of stage {s} overwritten while read"
            ws[s] = c
            full[s].complete_tx(1)

        inflight.append(land)

    reading_v = [[False] * W for _ in range(S)]

    def warp_program(w):
        for c in range(min(S, n)):
            fill_v(w, c, c)
            if w == c % 4 and mutate != "skip_ws":
                fill_ws(c, c)
            yield
        for i in range(n):
            s, parity = i % S, (i // S) % 2
            while not full[s].passed(parity):
                yield "wait"
            assert v[s][w] == i and ws[s] == i, (w, i, v[s][w], ws[s])
            reading[s][w] = True
            reading_v[s][w] = True
            if mutate == "v_before_read" and i + S < n:
                fill_v(w, i + S, s)
            yield
            reading_v[s][w] = False  # the v operand read (ldmatrix), then the refill
            if i + S < n and mutate != "v_before_read":
                fill_v(w, i + S, s)
            yield
            assert ws[s] == i
            reading[s][w] = False
            for _ in range(32):
                empty[s].arrive()
            if w == s % 4 and i + S < n:
                wait_parity = parity if mutate != "parity" else parity ^ 1
                while not empty[s].passed(wait_parity):
                    yield "wait"
                fill_ws(i + S, s)
            yield

    progs = [warp_program(w) for w in range(W)]
    alive = set(range(W))
    stuck = 0
    while alive or inflight:
        choices = [("w", w) for w in alive] + [("c", k) for k in range(len(inflight))]
        kind, x = rng.choice(choices)
        if kind == "c":
            inflight.pop(x)()
            stuck = 0
        else:
            try:
                r = next(progs[x])
                stuck = stuck + 1 if r == "wait" else 0
            except StopIteration:
                alive.discard(x)
                stuck = 0
        if stuck > 2000 and not inflight:
            if mutate == "count":
                raise RuntimeError("deadlock")
            raise RuntimeError(f"deadlock n={n} S={S}")
    assert all(b.pending == b.count and b.tx == 0 for b in full + empty), "barriers left mid-phase"


def check_pipeline() -> None:
    for stages in (STEPS, 6):
        for n in range(3 * stages + 3):
            for seed in range(60):
                run(n, stages, seed)
    for mutate in ("parity", "skip_ws", "count", "v_before_read"):
        caught = 0
        for stages in (STEPS, 6):
            for n in range(3 * stages + 3):
                for seed in range(20):
                    try:
                        run(n, stages, seed, mutate)
                    except (AssertionError, RuntimeError):
                        caught += 1
        assert caught, f"the model missed the seeded defect {mutate!r}"


if __name__ == "__main__":
    check_lane_maps()
    print("lane maps: ldmatrix and stmatrix match the current loads and stores")
    check_pipeline()
    print(
        "inline pipeline: no deadlock, every read sees its chunk (S = 4 and 6, 0 to 3S + 2 chunks); "
        "each seeded defect caught"
    )
