# Triton's autotune results on disk between device calls, sourced by the device scripts
# (gpu_session.sh, paired_runs_ab.sh, tree_ab.sh); they travel as one archive in .whl.
#
# One cache a card: Triton keys its disk cache by the compile target (sm_90), not by the card, so
# the H100s' results, read on an H200, timed fla there with the H100's configs (2026-12-05, run
# 162: fla's 1x131072 H32 16.354 ms and 1x32768 H32 4.134 against 14.717 and 3.731 on an H200 in
# run 142, the configs tuned on H100s in runs 158 and 160). Timings read and fill the cache of
# the card they run on ($AUTOTUNE_ROOT/<card name>); the tests, whose times are no figures, one
# cache for every card ($TESTS_TRITON_CACHE_DIR): fla's backward autotunes for minutes from an
# empty cache (run 153 lost seven tests to the call's limit that way).
AUTOTUNE_ROOT=/tmp/triton-autotune
AUTOTUNE_ARCHIVE=triton-autotune-cards.tgz
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9\n' '_')
card=${card:-unknown_card}  # (no name: never the root, which holds every card's cache)
mkdir -p "$AUTOTUNE_ROOT/$card" "$AUTOTUNE_ROOT/tests"
[[ -f .whl/$AUTOTUNE_ARCHIVE ]] && tar xzf ".whl/$AUTOTUNE_ARCHIVE" -C "$AUTOTUNE_ROOT"
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$AUTOTUNE_ROOT/$card TESTS_TRITON_CACHE_DIR=$AUTOTUNE_ROOT/tests
echo "autotune cache of $card: $(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l) entries;" \
  "the tests': $(find "$TESTS_TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l)"
# (into $1, default $OUT: the device tool brings back what is there)
save_autotune() { (cd "$AUTOTUNE_ROOT" && find . -name '*.autotune.json' | tar czf "${1:-$OUT}/$AUTOTUNE_ARCHIVE" -T -); }
