#!/usr/bin/env bash
# One device call on the lent GPU machine: install the carried wheels (.whl),
# run the GPU tests, the demo and the benchmarks; results go to $OUT.
# Usage (device tool, carry [".whl"]): [PART=1|2|3] [STEP="1 2 3 4"] bash scripts/gpu_check.sh [pending|tests|bench|seed|ln|ln_mosaic|attn|attn_bench|mosaic|mosaic_bwd|ncu|trace|mosaic_bias|ln_loop|kernels|gpu_tests|ship_mosaic|ln_alloc|ln_params|ln_vjp|flag_ab|final|ship|upstream|all]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/tokamax_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
status=0
# Test processes sharing the GPU: 14 fit the H200's 141 GB; on an 80 GB
# H100, 8 processes ran out of memory in the real-size tests (2026-12-07
# 16:41), 3-4 did not.
MEM_MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [[ ${MEM_MB:-0} -gt 100000 ]]; then DEFAULT_JOBS=14; else DEFAULT_JOBS=4; fi
# Text pages of the Nsight Compute report /tmp/ncu/$1.ncu-rep: details, raw
# metrics (CSV) and per-instruction SASS samples (CSV).
ncu_pages() {
  ncu -i "/tmp/ncu/$1.ncu-rep" --page details > "/tmp/ncu/$1.txt" 2>&1
  ncu -i "/tmp/ncu/$1.ncu-rep" --page raw --csv > "/tmp/ncu/${1}_raw.csv" 2>&1
  ncu -i "/tmp/ncu/$1.ncu-rep" --page source --print-source sass --csv > "/tmp/ncu/${1}_sass.csv" 2>&1
}
if [[ $what == all || $what == tests ]]; then
  # The demo's autotuning results land in $OUT/cache (shipped cache candidates).
  TOKAMAX_CACHE_DIR="$OUT/cache" python3 scripts/demo.py 2>&1 | tee "$OUT/demo.log" || status=1
  # Several test processes share the GPU: no preallocation.
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -n 4 -p no:cacheprovider \
    -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -n 4 -p no:cacheprovider \
    tests/test_dispatch.py tests/test_autotuning.py 2>&1 | tail -5 | tee -a "$OUT/gpu_tests.log" || status=1
fi
if [[ $what == ship ]]; then
  # Tune the benchmark shapes into the shipped cache, then time layer_norm with it.
  TOKAMAX_CACHE_DIR=$PWD/tokamax/data/autotuning python3 benchmarks/tune_shipped.py \
    2>&1 | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/tune.log" | tail -20
  mkdir -p "$OUT/cache" && cp tokamax/data/autotuning/*/*.json "$OUT/cache/"
  python3 benchmarks/layer_norm.py "$OUT" 2>&1 | tee "$OUT/ln_bench.log" | tail -12
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -n 4 -p no:cacheprovider \
    tests/test_autotuning.py 2>&1 | tail -4
  exit
fi
if [[ $what == pending ]]; then
  # Steps 1-4 ran on the H200 and step 5 on an H100 on 2026-12-05 (09:04-):
  # docs/benchmarks.md has the results; kept to re-run after changes.
  # Steps 6 and 7 ran on the H200, step 8 on an H100 on 2026-12-05 (11:52-);
  # Steps 8 and 9 ran on the H200, 10 and 11 on an H100 on 2026-12-05
  # (14:55-); the persistent tests and step 8 (tests on an H100, the rest of
  # the class and the benchmark on the H200; K narrows its tests) on
  # 2026-12-05 (17:32-). Step 15 ran on an H100 on 2026-12-05 (20:20-).
  # Steps 8, 26 (2 rounds, without its H128 point) and 27 ran on the H200 on
  # 2026-12-06 (22:27-).
  # Step 12's A/B is still untimed. Step 30, and 27 with BATCH=1/2/4, ran
  # on an H100 on 2026-12-07 (10:33-); steps 31, 32 and 33 on an H100 on
  # 2026-12-07 (13:27-), step 34 on an H100 on 2026-12-07 (16:41-).
  # The checks of the 2026-12-05 (02:50) changes, STEP (several in one call:
  # STEP="1 2 3"): 1 the attention GPU tests at real sizes and every head
  # dim (the "triton" heuristic's row halves at head dim 128, its bands of
  # 4, the band-1 rule up to 33 heads in both kernels); 2 the layer_norm
  # wide GPU tests, then `implementation=None` ("auto": the "triton"
  # forward, XLA's VJP for rows) against XLA above 16384 features; 3 the
  # causal H128 and GQA forward+backward at the defaults against cuDNN;
  # 4 "mosaic" at 17-33 heads with the band-1 rule against bands of 8.
  # Steps 1 and 2 also run the forward-mode tests (2026-12-05, 06:17: kernels
  # refuse jax.jvp by name, None falls back to "xla"), and step 1 the bias
  # and window features (the "mosaic" dq kernel's dbias zero-fill clamped),
  # step 2 the one-feature layer norm (dx exactly 0). Step 2t: its tests
  # only, 2b: its benchmark only.
  pt() { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 20 "$1" python3 -m pytest -q \
    -n ${JOBS:-$DEFAULT_JOBS} -p no:cacheprovider -rfE --tb=short -m gpu "${@:2}" 2>&1 \
    | grep -v "PytestBenchmarkWarning\|warner(" | tail -25; }
  # The "mosaic" persistent-kernel GPU tests, logged as step $1's.
  persistent_tests() { pt 150 tests/test_attention.py -k "TestMosaicGpu and persistent" \
    | tee "$OUT/pending_$1_tests.log"; }
  # Per-kernel A/B of "mosaic" VJP config field $2 (False against True) at
  # the shapes $3, rows in $OUT/$1, at most $4 s (SET passes through).
  vjp_ab() { mkdir -p "$OUT/$1"
    PAUSE_S=1 timeout "$4" python3 benchmarks/attention_variance.py "$OUT/$1" 3 "$3" \
      "vjp.$2" False,True 2>&1 | grep -v "cuda_timer\|Delay kernel" | grep "^{" \
      | cut -c1-300 | tail -30; }
  export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
  for step in ${STEP:-1}; do
  case $step in
    # Step 1 at 14 processes ran out of GPU memory in two "mosaic" real-size
    # tests (2026-12-05 09:50; they pass at 3): 6 by default.
    1) JOBS=${JOBS:-6} pt ${TEST_S:-300} tests/test_attention.py \
         -k "(TritonGpu or TestMosaicGpu or TestCudnn) and (real_size or head_dims or forward_mode or bias or window)" \
         | tee "$OUT/pending_attention_tests.log" ;;
    2|2t|2b) [[ $step == 2b ]] || pt 120 tests/test_layer_norm.py \
         -k "wide or chunked or forward_mode or one_feature" | tee "$OUT/pending_ln_tests.log"
       [[ $step == 2t ]] || SHAPES="4096x18432,1024x65536,16x32768x64 axis 1" IMPLS=auto,triton,xla timeout 150 \
         python3 benchmarks/layer_norm.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -16 ;;
    3) for flag in "HEAVY_FIRST_BAND 8" "triton.HEAVY_FIRST_BAND 4"; do
         set -- $flag; mkdir -p "$OUT/${1//./_}"
         PAUSE_S=1 timeout 150 python3 benchmarks/attention_variance.py "$OUT/${1//./_}" 4 \
           "GQA,H128 causal" "$1" "$2" 2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -6
       done ;;
    # 5 (2026-12-05 09:04): the forward-mode tests at f32 matmul precision,
    # the one-feature layer_norm and the dbias feature on the GPU; then the
    # "mid" shapes at the defaults (band 1 only up to 16 CTAs per SM).
    5) pt 240 tests/test_attention.py tests/test_layer_norm.py \
         -k "forward_mode or (TestMosaicGpu and window_rows) or (TritonGpu and one_feature)" \
         | tee "$OUT/pending_5_tests.log"
       mkdir -p "$OUT/mid"
       PAUSE_S=1 timeout 150 python3 benchmarks/attention_variance.py "$OUT/mid" 3 mid \
         2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -8 ;;
    # 6 (queued 2026-12-05 10:45, not yet run): whether "triton" also wants
    # band 1 only for short grids, as "mosaic" does (B1 T16384 N32 differs,
    # B2 T8192 N12 is the control).
    6) mkdir -p "$OUT/triton_band_one"
       PAUSE_S=1 timeout 200 python3 benchmarks/attention_variance.py "$OUT/triton_band_one" 3 mid \
         triton.BAND_ONE_MAX_WAVES 36,16 2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -8 ;;
    # 7 (2026-12-05 12:05): the persistent forward (config.persistent):
    # its GPU tests, then an A/B of the shipped configs with and without it.
    7) pt 200 tests/test_attention.py -k "TestMosaicGpu and persistent" \
         | tee "$OUT/pending_7_tests.log"
       mkdir -p "$OUT/persistent"
       timeout 150 python3 benchmarks/attention_mosaic_config_ab.py "$OUT/persistent" \
         64.128.2.3,64.128.2.3.1 seed 3 2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -4
       mkdir -p "$OUT/persistent_h128"
       timeout 200 python3 benchmarks/attention_mosaic_config_ab.py "$OUT/persistent_h128" \
         64.128.2.2,64.128.2.2.1 H128 3 2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -4 ;;
    # 8 (2026-12-05 12:38): persistent by default (heuristic, search space,
    # shipped cache): the whole "mosaic" GPU class, then the attention
    # benchmark (forward and forward+backward) against cuDNN and XLA.
    # K narrows the tests (a -k expression; default the whole class).
    8) JOBS=${JOBS:-8} pt ${TEST_S:-300} tests/test_attention.py -k "${K:-TestMosaicGpu}" \
         | tee "$OUT/pending_8_tests.log"
       timeout ${BENCH_S:-220} python3 benchmarks/attention.py "$OUT" mosaic,jax.nn 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/attention_bench.log" | tail -16 ;;
    # 9 (2026-12-05 12:50): the persistent dq kernel (vjp dq_persistent):
    # its GPU tests, then per-kernel A/B at the shipped VJP configs.
    9) persistent_tests 9
       vjp_ab dq_persistent dq_persistent "seed,B8 T4096,GQA" 200 ;;
    # 10 (2026-12-05 15:40): the persistent dk/dv kernel (vjp
    # dkdv_persistent): the persistent GPU tests (all three kernels), then
    # per-kernel A/B at the shipped VJP configs.
    10) persistent_tests 10
       vjp_ab dkdv_persistent dkdv_persistent "seed,B8 T4096,GQA" 240 ;;
    # 11 (2026-12-05 15:50): the persistent GPU tests again at 2 processes
    # (4 of step 10's ran out of memory at 6 on an H100), then the attention
    # benchmark at the new VJP defaults (dq persistent without causal
    # bands, dk/dv persistent at head dim 64).
    11) JOBS=${JOBS:-2} pt ${TEST_S:-200} tests/test_attention.py -k "TestMosaicGpu and persistent" \
         | tee "$OUT/pending_11_tests.log"
       timeout ${BENCH_S:-200} python3 benchmarks/attention.py "$OUT" mosaic,jax.nn 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/attention_bench.log" | tail -40 ;;
    # 12 (2026-12-05 16:20): the persistent dk/dv kernel at head dim 128
    # with its next K/V loaded as a tile starts (fewer ptxas spills there):
    # its GPU tests (with the other persistent ones), then per-kernel A/B
    # against the per-tile kernel, and the first-step prefetch's A/B again
    # (step 10's H128 losses) in the same call.
    12) persistent_tests 12
       SET="DKDV_PREFETCH_AT_TILE_START=True" vjp_ab dkdv_prefetch_start dkdv_persistent \
         "B8 T4096,GQA" 150
       vjp_ab dkdv_prefetch_first_step dkdv_persistent "B8 T4096,GQA" 150 ;;
    # 15 (2026-12-05 18:45; ran on an H100 on 2026-12-05 21:35, dk/dv only
    # shipped since): both backward kernels computing p's
    # exponentials while dp = do v^T runs (EXP_UNDER_DP, as cuDNN's bprop
    # does): the GPU tests, then the per-kernel A/B at the benchmark shapes
    # (attention_variance prints the per-round changes per kernel; each
    # kernel's own change decides its member of the tuple).
    15) JOBS=${JOBS:-3} pt ${TEST_S:-150} tests/test_attention.py -k "exp_under_dp" \
         | tee "$OUT/pending_15_tests.log"
       mkdir -p "$OUT/exp_under_dp"
       PAUSE_S=1 timeout ${AB_S:-400} python3 benchmarks/attention_variance.py "$OUT/exp_under_dp" \
         ${ROUNDS:-3} "${SHAPES:-seed,B8 T4096,GQA}" EXP_UNDER_DP "(),('dkdv','dq')" 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | grep -v "^{" | tail -40 ;;
    # 17 (2026-12-05 23:50; ran on an H100 on 2026-12-06 06:10, (2, 2)
    # stays): ring depths at the seed shapes now that the
    # dk/dv kernel computes its exponentials under dp (the shipped configs
    # were tuned before): per-kernel A/B of (dk/dv stages, dq stages) 2,2
    # (shipped) against 3,2 and 2,3; 3 dk/dv stages fit without spills
    # (ptxas, CPU), 128-query dk/dv steps spill 184+ bytes.
    17) mkdir -p "$OUT/stages"
       PAUSE_S=1 timeout ${AB_S:-400} python3 benchmarks/attention_variance.py "$OUT/stages" \
         ${ROUNDS:-3} "${SHAPES:-seed}" "vjp.num_stages+dq_num_stages" "(2,2),(3,2),(2,3)" 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | grep -v "^{" | tail -40 ;;
    # 18 (2026-12-06 00:15; ran on an H100 on 2026-12-06 04:14, K/V
    # registers shipped, Q registers not): register operands instead of shared memory,
    # the dk/dv kernel's K and V (DKDV_KV_REGS_MAX_WIDTH 128 against 0) and
    # the forward's Q (FWD_Q_REGS): their GPU tests, then per-kernel A/Bs at
    # the seed shapes.
    18) JOBS=${JOBS:-4} pt ${TEST_S:-150} tests/test_attention.py -k "kv_regs or q_regs" \
         | tee "$OUT/pending_18_tests.log"
       for ab in "DKDV_KV_REGS_MAX_WIDTH 0,128" "FWD_Q_REGS False,True"; do
         read -r flag values <<< "$ab"; mkdir -p "$OUT/$flag"
         PAUSE_S=1 timeout ${AB_S:-150} python3 benchmarks/attention_variance.py "$OUT/$flag" \
           ${ROUNDS:-3} "${SHAPES:-seed}" "$flag" "$values" 2>&1 \
           | grep -v "cuda_timer\|Delay kernel" | grep -v "^{" | tail -14
       done ;;
    # 19 ran on an H100 on 2026-12-06 (04:08): max-free forward steps
    # (commits 22e0134, 66e03b2), not faster, removed (docs/benchmarks.md).
    # 20 (2026-12-06 05:44, ran on an H100): "mosaic" and cuDNN forward
    # throughput against sequence length at 65536 tokens (H64; per-tile
    # costs), for the H200 next.
    20) timeout ${BENCH_S:-170} python3 benchmarks/attention_length_scaling.py "$OUT" 3 64 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | tail -12 ;;
    # 23 (2026-12-06 10:40; ran on an H100 10:03-10:33): D = rowsum(dO O)
    # computed by the dq kernel (DQ_DELTA): the tests of both paths and the
    # causal partial tiles (where a D store once ran into the next head's
    # rows), then per-kernel A/B against XLA's D.
    23) JOBS=${JOBS:-2} pt ${TEST_S:-150} tests/test_attention.py \
         -k "TestMosaicGpu and (dq_delta_real_size or shape3-True or shape5-True)" \
         | tee "$OUT/pending_23_tests.log"
       mkdir -p "$OUT/dq_delta"
       PAUSE_S=1 timeout ${AB_S:-240} python3 benchmarks/attention_variance.py "$OUT/dq_delta" \
         ${ROUNDS:-3} "${SHAPES:-seed B32,seed causal,H128 causal,B8 T4096}" DQ_DELTA \
         False,True 2>&1 | grep -v "cuda_timer\|Delay kernel" | grep -v "^{" | tail -20 ;;
    # 25 (2026-12-06 16:45): forward+backward against sequence length,
    # "mosaic" and cuDNN, at head dims 64 and 128 (whether "mosaic" should
    # come before cuDNN under implementation=None).
    25) for h in 64 128; do mkdir -p "$OUT/scaling_fb_h$h"
         if [[ $h == 64 ]]; then lens=1024,2048,4096,8192 limit=${FB64_S:-250}
         else lens=2048,4096,8192 limit=${FB128_S:-170}; fi
         timeout $limit python3 benchmarks/attention_length_scaling.py "$OUT/scaling_fb_h$h" \
           ${ROUNDS:-3} $h $lens forward_and_vjp 2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -10
       done ;;
    # 26 (2026-12-06 19:00; ran on an H100 19:16): the implementation=None rule at head dim 64
    # (plain attention, T = S) on the GPU at hand: forward, then
    # forward+backward, causal and not, at T 1024-4096 (3072 included: the
    # rule's edges), then head dim 128 at T 8192 forward+backward (step 25's
    # missing causal point).
    26) lens=${LENS:-1024,2048,3072,4096}
       for mode in forward forward_and_vjp; do mkdir -p "$OUT/rule_h64_$mode"
         if [[ $mode == forward ]]; then limit=${FWD_S:-130}; else limit=${FB64_S:-230}; fi
         timeout $limit python3 benchmarks/attention_length_scaling.py "$OUT/rule_h64_$mode" \
           ${ROUNDS:-3} 64 $lens $mode 2>&1 | grep -v "cuda_timer\|Delay kernel" \
           | tee "$OUT/rule_h64_$mode/log.txt" | tail -10
       done
       mkdir -p "$OUT/fb_h128_8192"
       timeout ${FB128_S:-150} python3 benchmarks/attention_length_scaling.py "$OUT/fb_h128_8192" \
         ${ROUNDS:-3} 128 8192 forward_and_vjp 2>&1 | grep -v "cuda_timer\|Delay kernel" \
         | tee "$OUT/fb_h128_8192/log.txt" | tail -6 ;;
    # 28 (2026-12-07 02:50): the small-grid rules of implementation=None
    # (ran on an H100 only): the dispatch GPU tests, then "mosaic" against
    # cuDNN at batch 1 (BATCH), head dims 128 and 64, N8 and N16,
    # forward+backward then forward, causal and not (about 9 min for both
    # head dims: SMALL_H=128, then SMALL_H=64 in a second call; SMALL_H=""
    # runs the tests only).
    28) pt ${TEST_S:-150} tests/test_dispatch.py | tee "$OUT/pending_28_tests.log"
       for h in ${SMALL_H-128 64}; do for n in 8 16; do for mode in forward_and_vjp forward; do
         d="$OUT/small_h${h}_n${n}_$mode"; mkdir -p "$d"
         BATCH=1 timeout ${SMALL_S:-70} python3 benchmarks/attention_length_scaling.py "$d" \
           ${ROUNDS:-3} $h ${LENS:-4096,8192} $mode $n 2>&1 \
           | grep -v "cuda_timer\|Delay kernel" | tee "$d/log.txt" | grep "^B"
       done; done; done ;;
    # 30 (2026-12-07 08:40): head dim 64, N16, T 1024 and 2048, forward,
    # causal and not, at B 1-32 (16384-1M rows) with the consumers-by-rounds
    # heuristic: whether `_MOSAIC_INFERS_FASTER` (cudnn.py) should take
    # causal T2048 ("mosaic" 1.45x at B1 N16, 0.98x at B1 N8 on an H100).
    30) for b in ${BATCHES:-1 2 4 8 32}; do d="$OUT/causal_fwd_b$b"; mkdir -p "$d"
         BATCH=$b timeout ${SMALL_S:-70} python3 benchmarks/attention_length_scaling.py "$d" \
           ${ROUNDS:-3} 64 ${LENS:-1024,2048} forward 16 2>&1 \
           | grep -v "cuda_timer\|Delay kernel" | tee "$d/log.txt" | grep "^B"
       done ;;
    # 36 (2026-12-07 23:05; ran on an H100 23:09): REVERSE_CAUSAL_KEYS per
    # kernel in each MODE of attention_variance.py (inference forward, the
    # forward saving lse, forward+backward), then the persistent tests.
    36) for m in ${MODES:-forward residuals forward_and_vjp}; do mkdir -p "$OUT/ab_$m"
         MODE=$m PAUSE_S=1 timeout ${AB_S:-140} python3 benchmarks/attention_variance.py \
           "$OUT/ab_$m" ${ROUNDS:-4} "${SHAPES:-seed causal,short causal}" \
           REVERSE_CAUSAL_KEYS "(),(3,)" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
           | grep -A4 "against" | tee "$OUT/ab_$m/log.txt"
       done
       persistent_tests 36 ;;
    # 35 (2026-12-07 20:40; ran on an H100 22:55: forward kernel +0.8 to
    # +2.3 % at the seed shape causal, -2.3 to -4.0 % at B64 T1024; one test
    # ran out of memory at 4 processes, passed alone): REVERSE_CAUSAL_KEYS (shipped for
    # three consumers at 19:40 from forward A/Bs on an H100). Per-kernel
    # forward+backward A/B at the seed shape causal and B64 T1024 (the
    # forward+backward A/B did not move although the forward gained 3 %),
    # then the "mosaic" real-size and persistent GPU tests at the default.
    35) mkdir -p "$OUT/reverse_keys"
       PAUSE_S=1 timeout ${AB_S:-200} python3 benchmarks/attention_variance.py "$OUT/reverse_keys" \
         ${ROUNDS:-4} "seed causal,short causal" REVERSE_CAUSAL_KEYS "(),(3,)" 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | tail -14
       pt ${TEST_S:-240} tests/test_attention.py \
         -k "TestMosaicGpu and (test_real_size or persistent_real_size or reverse_causal or deterministic)" \
         | tee "$OUT/pending_35_tests.log" ;;
    # 34 (2026-12-07 14:55; ran on an H100 at 16:48, 10 % slower, dropped;
    # its tests then ran at 14 processes and hit the 80 GB card's memory,
    # hence JOBS 4 in 33 and 34): needs
    # `git cherry-pick --no-commit 4191324` first. FWD_QK_AHEAD = 2: a turn
    # issues P_{j-1} V, then Q K_j^T, and passes the token once P V is done,
    # so the consumers stay staggered (what step 33's variant lost) without
    # the drain between a turn's two products. Forward A/B at head dim 128
    # (two consumers: no spills), then its GPU tests (every mode).
    34) mkdir -p "$OUT/ahead_2"
       timeout ${AB_S:-150} python3 benchmarks/attention_mosaic_flag_ab.py "$OUT/ahead_2" \
         FWD_QK_AHEAD "None,2" forward "${SHAPES:-B8,GQA}" 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/ahead_2/log.txt" | grep "^{"
       JOBS=${JOBS:-4} pt ${TEST_S:-150} tests/test_attention.py -k qk_ahead | tee "$OUT/pending_34_tests.log" ;;
    # 33 (2026-12-07 14:20; ran on an H100 14:41 without its tests, dropped;
    # needs `git cherry-pick --no-commit eae8db4`): FWD_QK_AHEAD, a turn's Q K_j^T and P_{j-1} V
    # issued back to back (wait for both): forward A/Bs against the shipped
    # turns, then its GPU tests (both waits): the seed shape's three
    # consumers with the producer at 24 registers (at 40, ptxas serialises
    # the wgmmas: C7512), and head dim 128 (two consumers).
    33) ab() { mkdir -p "$OUT/$1"; timeout ${AB_S:-150} python3 benchmarks/attention_mosaic_flag_ab.py \
           "$OUT/$1" "$2" "$3" forward "$4" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
           | tee "$OUT/$1/log.txt" | grep "^{"; }
       ab ahead_seed "FWD_QK_AHEAD,_PRODUCER_REGS" "(None,40),(0,24)" seed
       ab ahead_h128 FWD_QK_AHEAD "None,0" B8
       JOBS=${JOBS:-4} pt ${TEST_S:-150} tests/test_attention.py -k qk_ahead | tee "$OUT/pending_33_tests.log" ;;
    # 32 (2026-12-07 13:45): GQA (N32 K8 H128) forward+backward where the
    # causal training rule (T 2048-4096 up to 524288 rows) has no data:
    # T 8192 at B1 and B2 (262144, 524288 rows), and B8 at T 2048-4096
    # (524288, 1048576 rows), causal and not.
    32) for b in ${GQA_BATCHES:-1:8192 2:8192 8:2048,4096}; do
         d="$OUT/gqa_fb_b${b%%:*}"; mkdir -p "$d"
         BATCH=${b%%:*} timeout ${GQA_S:-150} python3 benchmarks/attention_length_scaling.py "$d" \
           ${ROUNDS:-3} 128 ${b##*:} forward_and_vjp 32 8 2>&1 \
           | grep -v "cuda_timer\|Delay kernel" | tee "$d/log.txt" | grep "^B"
       done ;;
    # 31 (2026-12-07 11:45; ran on an H100 at 13:27): the queued H200 checks in one call: the
    # dispatch GPU tests (MQA causal T2048 trains with "mosaic" since
    # 10:33), "mosaic" forward at B1 T4096 N8 H64 (the heuristic, not the
    # seed's cached three consumers: about 0.94x cuDNN, not 0.71x), then
    # the benchmark table at the shipped defaults.
    31) pt ${TEST_S:-100} tests/test_dispatch.py | tee "$OUT/pending_31_tests.log"
       d="$OUT/b1_t4096_n8_h64"; mkdir -p "$d"
       BATCH=1 timeout ${SMALL_S:-60} python3 benchmarks/attention_length_scaling.py "$d" \
         ${ROUNDS:-3} 64 4096 forward 8 2>&1 | grep -v "cuda_timer\|Delay kernel" \
         | tee "$d/log.txt" | grep "^B"
       timeout ${BENCH_S:-330} python3 benchmarks/attention.py "$OUT" 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/bench.log" | tail -40 ;;
    # 29 (2026-12-07 04:45): the persistent forward's last wave on small
    # non-causal head-dim-64 grids: three consumers (192-row tiles, the
    # heuristic's) against two (128-row tiles) at 16384-131072 rows, where
    # the tile count against 132 CTAs decides how full the last round is.
    29) mkdir -p "$OUT/small_wave"
       timeout ${AB_S:-240} python3 benchmarks/attention_mosaic_config_ab.py "$OUT/small_wave" \
         ${CONFIGS:-64.128.2.3.1,64.128.2.2.1} "${SHAPES:-small}" ${ROUNDS:-3} 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/small_wave/log.txt" | grep "^{" ;;
    # 29b: the same for the dq kernel (three consumers over 64-key steps at
    # head dim 64, persistent non-causal), per kernel beside cuDNN.
    29b) mkdir -p "$OUT/small_wave_dq"
       PAUSE_S=1 timeout ${AB_S:-240} python3 benchmarks/attention_variance.py \
         "$OUT/small_wave_dq" ${ROUNDS:-3} "${DQ_SHAPES:-small non-causal}" vjp.dq_consumers 3,2 2>&1 \
         | grep -v "cuda_timer\|Delay kernel\|^{" | cut -c1-160 | tail -45 ;;
    # 27 (2026-12-06 20:40): GQA at head dim 128 (N32 K8) against sequence
    # length, forward then forward+backward, causal and not: "mosaic" was
    # 1.05x cuDNN forward and 1.00-1.06x forward+backward at T 4096 causal in
    # every run since 2026-12-05, the one GQA point behind a possible
    # implementation=None rule.
    27) for mode in forward forward_and_vjp; do mkdir -p "$OUT/gqa_$mode"
         timeout ${GQA_S:-200} python3 benchmarks/attention_length_scaling.py "$OUT/gqa_$mode" \
           ${ROUNDS:-3} 128 ${LENS:-2048,4096,8192} $mode 32 8 2>&1 \
           | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/gqa_$mode/log.txt" | tail -8
       done ;;
    # 24 (2026-12-06 13:20; ran on an H100 on 2026-12-06 15:58, dropped):
    # D computed under the dq kernel's first products, O on a barrier of its
    # own (DQ_DELTA_UNDER_PRODUCTS): the D tests of the three paths and the
    # causal partial tiles, then per-kernel A/B against D at the tile's
    # start. Needs `git cherry-pick --no-commit 12a7b5a 75e8be1` first (the
    # switch was removed after the A/B).
    24) JOBS=${JOBS:-2} pt ${TEST_S:-200} tests/test_attention.py \
         -k "TestMosaicGpu and (dq_delta_real_size or shape3-True or shape5-True)" \
         | tee "$OUT/pending_24_tests.log"
       mkdir -p "$OUT/dq_delta_steps"
       PAUSE_S=1 timeout ${AB_S:-240} python3 benchmarks/attention_variance.py \
         "$OUT/dq_delta_steps" ${ROUNDS:-3} \
         "${SHAPES:-seed causal,H128 causal,seed B32,B8 T4096}" DQ_DELTA_UNDER_PRODUCTS \
         False,True 2>&1 | grep -v "cuda_timer\|Delay kernel" | grep -v "^{" | tail -20 ;;
    # 22 (2026-12-06 08:30; ran on an H100 on 2026-12-06 08:20, forward
    # shipped): causal query tiles starting before row 0
    # (SHIFT_CAUSAL_TILES) on the H200: the causal GPU tests with partial
    # tiles, then per-kernel A/B of neither kernel, the forward (shipped)
    # and both, then the length scaling at the new default.
    22) T=tests/test_attention.py::TestMosaicGpu
       JOBS=${JOBS:-3} pt ${TEST_S:-160} "$T::test_real_size_shapes[shape3-True]" \
         "$T::test_real_size_shapes[shape4-True]" "$T::test_real_size_shapes[shape5-True]" \
         "$T::test_persistent_real_size[shape0-3-True]" "$T::test_vjp_three_dq_consumers_configs" \
         | tee "$OUT/pending_22_tests.log"
       mkdir -p "$OUT/shift"
       PAUSE_S=1 timeout ${AB_S:-240} python3 benchmarks/attention_variance.py "$OUT/shift" \
         ${ROUNDS:-4} "${SHAPES:-seed causal,short causal}" SHIFT_CAUSAL_TILES \
         "(),('fwd',),('fwd','dq')" 2>&1 | grep -v "cuda_timer\|Delay kernel" | grep -v "^{" | tail -20
       timeout ${BENCH_S:-170} python3 benchmarks/attention_length_scaling.py "$OUT" 3 64 2>&1 \
         | grep -v "cuda_timer\|Delay kernel" | tail -12 ;;
    # 21 (2026-12-06 07:10; ran on an H100 on 2026-12-06 07:43, a 3-deep
    # ring does not rescue it): the tiles-as-one-sequence forward (dropped at a
    # 2-deep ring, docs/benchmarks.md 2026-12-06 05:30) with a 3-deep ring:
    # needs `git cherry-pick --no-commit 68e394c` in the checkout first
    # (FWD_TILE_PIPELINE; SET fails without it). Per-kernel A/B of the
    # forward's ring depth with the switch off, then on.
    21) for pipe in False True; do mkdir -p "$OUT/pipe_$pipe"
         SET="FWD_TILE_PIPELINE=$pipe" PAUSE_S=1 timeout ${AB_S:-200} python3 \
           benchmarks/attention_variance.py "$OUT/pipe_$pipe" ${ROUNDS:-3} "${SHAPES:-seed}" \
           fwd.num_stages 2,3 2>&1 | grep -v "cuda_timer\|Delay kernel" | grep -v "^{" | tail -10
       done ;;
    # 4: the widened band-1 rule where it is untimed: "mosaic" at 17-33
    # (batch, head) pairs, BAND_ONE_PER_HEAD 4 (band 1) against 8 (band 8).
    4) mkdir -p "$OUT/band_one"
       PAUSE_S=1 timeout 200 python3 benchmarks/attention_variance.py "$OUT/band_one" 4 mid \
         BAND_ONE_PER_HEAD 4,8 2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -12 ;;
  esac
  done
  exit
fi
if [[ $what == gpu_tests ]]; then
  # The demo (PART all or 3) and the GPU-marked tests of PART: the whole
  # suite (~757 tests) takes longer than one 10-minute call (2026-12-02:
  # 92 % in 545 s at -n 14), so a verification is three calls, PART=1
  # (Mosaic and cuDNN attention), 2 (the other attention tests), 3 (layer
  # norm, export). SIGINT at TEST_S, so pytest still prints its summary and
  # the JUnit XML names every test that ran.
  case ${PART:-all} in
    1) sel=(tests/test_attention.py -k "Mosaic or Cudnn") ;;
    2) sel=(tests/test_attention.py -k "not (Mosaic or Cudnn)") ;;
    3) sel=(tests/test_layer_norm.py tests/test_export.py) ;;
    *) sel=(tests) ;;
  esac
  if [[ ${PART:-all} == all || ${PART:-all} == 3 ]]; then
    TOKAMAX_CACHE_DIR="$OUT/cache" timeout 200 python3 scripts/demo.py > "$OUT/demo.log" 2>&1 \
      || { status=1; tail -5 "$OUT/demo.log"; }
    tail -4 "$OUT/demo.log"
  fi
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 20 ${TEST_S:-460} python3 -m pytest -q -n ${JOBS:-$DEFAULT_JOBS} \
    -p no:cacheprovider -rfE --tb=short --durations=15 --junitxml="$OUT/gpu_tests.xml" \
    -m gpu "${sel[@]}" 2>&1 | grep -v "PytestBenchmarkWarning\|warner(" | tee "$OUT/gpu_tests.log" | tail -30
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  exit $status
fi
if [[ $what == ship_mosaic ]]; then
  # Tune "mosaic" (forward and VJP) at the attention benchmark shapes into
  # the shipped cache (TUNE=mosaic_seed: the seed shape only); copy it to
  # $OUT/cache. BENCH=1: then the dispatch and
  # autotuning tests and the attention benchmark (a second call).
  if [[ -z ${BENCH:-} ]]; then
    TUNE=${TUNE:-mosaic} TOKAMAX_CACHE_DIR=$PWD/tokamax/data/autotuning timeout ${TUNE_S:-420} python3 benchmarks/tune_shipped.py \
      2>&1 | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/tune.log" | tail -40
    mkdir -p "$OUT/cache" && cp tokamax/data/autotuning/*/*.json "$OUT/cache/"
    exit
  fi
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_dispatch.py tests/test_autotuning.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
  timeout 300 python3 benchmarks/attention.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/bench.log" | tail -60
  exit
fi
if [[ $what == final ]]; then
  # Everything GPU-marked plus the layer_norm benchmark, inside one call.
  TOKAMAX_CACHE_DIR="$OUT/cache" timeout 200 python3 scripts/demo.py > "$OUT/demo.log" 2>&1 \
    || { status=1; tail -5 "$OUT/demo.log"; }
  tail -3 "$OUT/demo.log"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 360 python3 -m pytest -q -n 8 -p no:cacheprovider \
    -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 || status=1
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_dispatch.py tests/test_autotuning.py 2>&1 | tail -4 | tee -a "$OUT/gpu_tests.log"
  python3 benchmarks/layer_norm.py "$OUT" 2>&1 | tee "$OUT/ln_bench.log" | tail -14
  exit $status
fi
if [[ $what == kernels ]]; then
  # The Pallas kernels' GPU tests (Triton attention and layer_norm), dispatch.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 280 python3 -m pytest -q -n 8 -p no:cacheprovider \
    -m gpu tests/test_attention.py tests/test_layer_norm.py -k "Triton or triton" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -8 || status=1
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_dispatch.py 2>&1 | tail -3 | tee -a "$OUT/gpu_tests.log"
  exit $status
fi
if [[ $what == mosaic_bwd || $what == mosaic_bias ]]; then
  # GPU attention tests (TESTS = -k filter), then the Mosaic VJP sweep
  # (mosaic_bwd, SWEEP_S) or the bias/mask benchmark (mosaic_bias, BENCH_S).
  default_tests="Cudnn or Mosaic" bench=attention_mosaic_vjp_sweep limit=${SWEEP_S:-240}
  if [[ $what == mosaic_bias ]]; then
    default_tests="Mosaic" bench=attention_bias_mask limit=${BENCH_S:-240}
  fi
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_S:-300} python3 -m pytest -q -n 10 -p no:cacheprovider \
    -rf --tb=line -m gpu tests/test_attention.py -k "${TESTS:-$default_tests}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  timeout $limit python3 benchmarks/$bench.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/bench.log" | tail -80
  exit
fi
if [[ $what == mosaic ]]; then
  # Mosaic attention: GPU tests (TESTS = -k filter), then the config sweep.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_S:-300} python3 -m pytest -q -n 8 -p no:cacheprovider \
    -m gpu tests/test_attention.py -k "${TESTS:-Mosaic}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  timeout ${SWEEP_S:-300} python3 benchmarks/attention_mosaic_sweep.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/sweep.log" | tail -80
  exit
fi
if [[ $what == flag_ab ]]; then
  # Same-process A/B of a compile-time switch (benchmarks/attention_mosaic_flag_ab.py:
  # FLAG, VALUES, MODES, SHAPES), the forward accuracy table
  # (benchmarks/attention_accuracy.py), then the GPU attention tests
  # (TESTS = -k filter) with the module's defaults.
  timeout ${AB_S:-240} python3 benchmarks/attention_mosaic_flag_ab.py "$OUT" "${FLAG:-SUM_UNDER_PV}" \
    "${VALUES:-False,True}" "${MODES:-forward}" "${SHAPES:-}" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/ab.log" | tail -20
  timeout ${ACC_S:-120} python3 benchmarks/attention_accuracy.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/accuracy.log" | tail -30
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 20 ${TEST_S:-240} python3 -m pytest -q -n ${JOBS:-$DEFAULT_JOBS} \
    -p no:cacheprovider -rfE --tb=short -m gpu tests/test_attention.py -k "${TESTS:-TestMosaicGpu}" 2>&1 \
    | grep -v "PytestBenchmarkWarning\|warner(" | tee "$OUT/gpu_tests.log" | tail -20
  exit
fi
if [[ $what == attn ]]; then
  # Triton attention: GPU tests, then the config sweep at the benchmark shapes.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python3 -m pytest -q -n 4 -p no:cacheprovider \
    -m gpu tests/test_attention.py -k "${TESTS:-Triton}" -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  python3 benchmarks/attention_sweep.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/sweep.log" | tail -80
  exit
fi
if [[ $what == attn_bench ]]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -n 4 -p no:cacheprovider \
    -m gpu tests/test_layer_norm.py tests/test_attention.py -k "${TESTS:-Triton}" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -8
  # ONLY: a comma-separated filter of implementation labels (attention.py).
  python3 benchmarks/attention.py "$OUT" "${ONLY:-}" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/bench.log" | tail -60
  exit
fi
if [[ $what == ncu ]]; then
  # Nsight Compute (--set full, clocks left alone) on the attention kernels:
  # PROFILES = "impl:shape:causal:mode:kernel-regex:skip:count ..."; then the
  # layer_norm benchmark and the Mosaic config sweep (SWEEP_S) unless
  # BENCH=0. Reports and their text pages come back as $OUT/ncu.tar.gz ($OUT
  # returns at most 8 files).
  default="mosaic:seed:0:forward:tokamax:2:1 triton:seed:0:forward:tokamax:2:1"
  for p in ${PROFILES:-$default}; do
    IFS=: read -r impl shape causal mode pat skip count <<< "$p"
    name=ncu_${impl}_${shape}_c${causal}_${mode}_${pat//[^A-Za-z0-9]/}
    mkdir -p /tmp/ncu
    timeout 150 ncu --clock-control none --set full -k "regex:$pat" --launch-skip "$skip" \
      --launch-count "$count" -f -o "/tmp/ncu/$name" \
      python3 benchmarks/profile_attention.py "$impl" "$shape" "$causal" "$mode" 2>&1 | tail -3
    ncu_pages "$name"
    grep -E "Duration|Registers Per|Achieved Occ|Issue Slots Busy|Compute \(SM\) Th" "/tmp/ncu/$name.txt" | head -12
    # After every profile: a call cut short keeps the ones done.
    tar -C /tmp/ncu --exclude="*.ncu-rep" -czf "$OUT/ncu.tar.gz" .
  done
  [[ ${BENCH:-1} == 0 ]] && exit
  python3 benchmarks/layer_norm.py "$OUT" 2>&1 | tee "$OUT/ln_bench.log" | tail -14
  timeout ${SWEEP_S:-240} python3 benchmarks/attention_mosaic_sweep.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/sweep.log" | tail -60
  exit
fi
if [[ $what == trace ]]; then
  # In-kernel timelines of the Mosaic forward (Mosaic GPU's profiler on the
  # kernel's named regions): the trace test, then trace_mosaic.py per case.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/test_attention.py -k "trace" 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
  for c in ${TRACES:-seed:0 seed:1 h128:0}; do
    timeout 120 python3 benchmarks/trace_mosaic.py "$OUT" "${c%%:*}" "${c##*:}" 2>&1 | tail -60
  done
  exit
fi
if [[ $what == ln_loop ]]; then
  # layer_norm: the GPU tests, the sweep of looping forward configs, then
  # the benchmark with the shipped configs (forward and forward+backward).
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -n 4 -p no:cacheprovider \
    -m gpu tests/test_layer_norm.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
  timeout 300 python3 benchmarks/layer_norm_loop_sweep.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" \
    | tee "$OUT/ln_loop.log" | tail -60
  python3 benchmarks/layer_norm.py "$OUT" 2>&1 | tee "$OUT/ln_bench.log" | tail -20
  exit
fi
if [[ $what == ln_params ]]; then
  # layer_norm forward, f32 and bf16 scale/offset: the looping-forward GPU
  # tests, then the looping configs picked by BLOCKS, WARPS, PPS and DEPTHS
  # (layer_norm_loop_sweep.py's variables) at 8192^2 for each parameter
  # dtype, REPEATS times. EXTRA: a command run last.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider \
    -m gpu tests/test_layer_norm.py -k "looped_forward" 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
  for rep in $(seq ${REPEATS:-2}); do
    for dt in float32 bfloat16; do
      mkdir -p "$OUT/$dt-$rep"
      PARAM_DTYPE=$dt timeout ${SWEEP_S:-100} python3 benchmarks/layer_norm_loop_sweep.py \
        "$OUT/$dt-$rep" "" ${SHAPES:-8192x8192} 2>&1 | grep "tbps\|error" | tee "$OUT/$dt-$rep.log"
    done
  done
  [[ -n ${EXTRA:-} ]] && eval "$EXTRA"
  exit
fi
if [[ $what == ln_vjp ]]; then
  # layer_norm "triton" backward: the layer_norm GPU tests (prefetch
  # included), the autotuning and dispatch tests, then the shipped configs
  # at six shapes for bf16 and f32 x (benchmarks/layer_norm_vjp_sweep.py, one
  # log per dtype) and benchmarks/layer_norm.py (forward+backward vs XLA).
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 20 200 python3 -m pytest -q -n 14 -p no:cacheprovider \
    -rfE --tb=short -m gpu tests/test_layer_norm.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
  # 2026-12-03: 47 tests in 120 s at -n 8 (cut off); all 94 (with export) in 132 s at -n 14.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 20 240 python3 -m pytest -q -n 14 -p no:cacheprovider \
    -rfE --tb=short tests/test_autotuning.py tests/test_dispatch.py 2>&1 | tail -5 | tee -a "$OUT/gpu_tests.log"
  for dt in bfloat16 float32; do
    X_DTYPE=$dt ONLY_SHIPPED=1 timeout ${SWEEP_S:-90} python3 benchmarks/layer_norm_vjp_sweep.py \
      "$OUT/vjp_$dt" 8192x8192,65536x1024,16384x4096,32768x2048,131072x512,4096x16384 2>&1 \
      | grep "tbps\|error" | tee "$OUT/vjp_$dt.log"
  done
  timeout 150 python3 benchmarks/layer_norm.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/ln_bench.log" | tail -30
  exit
fi
if [[ $what == ln_mosaic ]]; then
  # Mosaic layer_norm: its GPU tests, the sweep (SWEEP = the sweep script's
  # arguments after OUT; SWEEP2 a second one into $OUT/b), then Nsight
  # Compute on the forward kernel for each "RxF:NAME=VALUE,..." of PROFILES
  # (text pages back as $OUT/ncu_ln.tar.gz).
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_S:-200} python3 -m pytest -q -n 12 -p no:cacheprovider \
    -m gpu tests/test_layer_norm.py -k "${TESTS:-Mosaic or mosaic}" 2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
  timeout ${SWEEP_S:-200} python3 benchmarks/layer_norm_mosaic_sweep.py "$OUT" ${SWEEP:-} 2>&1 \
    | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/sweep.log" | tail -40
  if [[ -n ${SWEEP2:-} ]]; then  # a second sweep, into $OUT/b
    mkdir -p "$OUT/b"
    timeout ${SWEEP2_S:-200} python3 benchmarks/layer_norm_mosaic_sweep.py "$OUT/b" $SWEEP2 2>&1 \
      | grep -v "cuda_timer\|Delay kernel" | tee "$OUT/b/sweep.log" | tail -40
  fi
  mkdir -p /tmp/ncu
  for p in ${PROFILES:-}; do
    name=ncu_ln_${p%%:*}_$(echo "${p#*:}" | tr -c 'A-Za-z0-9\n' _)
    timeout 120 ncu --clock-control none --set full -k regex:tokamax_layer_norm --launch-skip 2 \
      --launch-count 1 -f -o "/tmp/ncu/$name" python3 benchmarks/profile_layer_norm.py mosaic \
      "${p%%:*}" "${p#*:}" 2>&1 | tail -2
    ncu_pages "$name"
    grep -E "Duration|Registers Per|DRAM Throughput|Issue Slots Busy|Memory Throughput" "/tmp/ncu/$name.txt" | head -8
  done
  [[ -n ${PROFILES:-} ]] && tar -C /tmp/ncu -czf "$OUT/ncu_ln.tar.gz" .
  exit
fi
if [[ $what == ln_alloc ]]; then
  # The layer_norm benchmark under each of JAX's GPU allocators (the BFC
  # pool, plain cudaMalloc, cudaMallocAsync): ncu read the 8192^2 forward's
  # y writes as going through the L2 compression unit (docs/benchmarks.md,
  # 2026-12-02 20:12), so does the allocation change the ceiling?
  i=0
  for a in ${ALLOCATORS:-bfc platform cuda_async}; do
    i=$((i + 1)); mkdir -p "$OUT/$i-$a"
    SHAPES=${SHAPES:-8192x8192,65536x1024} MODES=forward REPEATS=${REPEATS:-4} \
      XLA_PYTHON_CLIENT_ALLOCATOR=$a timeout 150 python3 benchmarks/layer_norm.py "$OUT/$i-$a" 2>&1 \
      | grep -E "^[0-9]" | grep -E "forward +(mosaic|triton|xla|copy)" | sed "s/^/$a  /"
  done
  exit
fi
if [[ $what == upstream ]]; then
  # Ours against upstream Tokamax (PyPI), each in its own process (both are
  # `tokamax`): carry [".whl", ".whl_up"], .whl_up holding the upstream wheel
  # and its dependencies (made by scripts/fetch_upstream_wheels.sh).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/upstream .whl_up/*.whl || exit 1
  # RUNS: "label:library:groups" triples (benchmarks/upstream.py's GROUPS).
  for run in ${RUNS:-pypi:pypi:attention,layer_norm ours:ours:attention,layer_norm}; do
    IFS=: read -r label lib groups <<< "$run"
    path=$PWD; [[ $lib == pypi ]] && path=/tmp/upstream
    (cd benchmarks && PYTHONPATH=$path:/tmp/site timeout ${LIB_S:-270} \
      python3 upstream.py run "$OUT" "$label" "$groups" 2>&1 \
      | grep -v "cuda_timer\|Delay kernel\|Autotuning cache miss" \
      | tee "$OUT/upstream_$label.log" | cut -c1-200 | tail -4)
  done
  python3 benchmarks/upstream.py compare "$OUT" | tee "$OUT/upstream.md" | tail -70
  exit
fi
if [[ $what == ln ]]; then
  python3 benchmarks/layer_norm_sweep.py "$OUT" 2>&1 | grep -v "cuda_timer\|Delay kernel" | tail -20
  python3 benchmarks/layer_norm.py "$OUT" 2>&1 | tee "$OUT/ln_bench.log" | tail -20
  exit
fi
if [[ $what == all || $what == bench || $what == seed ]]; then
  if [[ $what == seed ]]; then
    TOKAMAX_CACHE_DIR="$OUT/cache" python3 benchmarks/seed_flow.py "$OUT" 2>&1 | tee "$OUT/seed_flow.log" | tail -40
    python3 benchmarks/export_determinism.py 2>&1 | tail -2 | tee "$OUT/determinism.log"
    XLA_FLAGS=--xla_gpu_deterministic_ops=true python3 benchmarks/export_determinism.py \
      2>&1 | tail -2 | tee -a "$OUT/determinism.log"
    exit
  fi
  python3 benchmarks/seed_flow.py "$OUT" 2>&1 | tee "$OUT/seed_flow.log" | tail -40 || status=1
  python3 benchmarks/attention.py "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60 || status=1
  python3 benchmarks/layer_norm.py "$OUT" 2>&1 | tee "$OUT/ln_bench.log" | tail -20 || status=1
fi
exit $status
