#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, sanitizers, Python package, benchmark.
# Usage: bash scripts/gpu_run.sh [build] [test] [sanitize] [python] [bench] [recipes] [quickbench] [hostbench] [timingmodes] [profile] [digest] [ab] [dist] [distbench] [dimbench] [mlabench] [windowbench] [varlenbench] [bwdbench] [bwdab] [parity] [bwdprofile]
# Results land in $OUT (at most 8 files come back): logs, JSON and Markdown.
# bench: BENCH_RUNS runs of the grid (default 3), merged into $OUT/h100.{json,md} by their
# per-point median (bench/merge_runs.py).
# recipes (not a default stage; needs the python stage's package): every preset's whole-call
# speed at d 64/128, N 1K/4K/16K, non-causal fp16 -> $OUT/h100_recipes.json, the file
# docs/recipes.md's speed table reads (copy it to bench/results/, then bash scripts/gen_docs.sh).
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
stages=${*:-build test sanitize python bench}
has() { [[ " $stages " == *" $1 "* ]]; }
log() { echo "== $(date +%T) $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/device.txt"
BUILD=build-gpu-run
# Stages that import the sagekit package: without the python stage in this call, a package
# installed by an earlier call on the same warm machine must be there (else stop now, before
# the build spends the call's time).
if ! has python; then
  for stage in bench recipes timingmodes hostbench quickbench dist distbench dimbench mlabench \
               varlenbench bwdab bwdbench parity bwdprofile; do
    if has $stage && ! python3 -c "import sagekit" 2> /dev/null; then
      echo "gpu_run.sh: the $stage stage needs the sagekit package: add the python stage"
      exit 2
    fi
  done
fi
if has build; then
  log build
  # TARGETS (e.g. sage_cli) limits what is built; CUDA_FLAGS adds nvcc flags (e.g. -lineinfo);
  # SAGE_HEAD_DIMS (e.g. "64;128") limits the kernels' head dims (the python stage follows it).
  # The Python extension is configured here too (the python stage builds its wheel in this
  # folder, so the kernels are compiled once), for the interpreter that pip uses. Tests and
  # CLI are named: a python stage run alone first leaves them off in the folder's cache.
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DSAGE_GTEST_SOURCE_DIR=$PWD/.deps/googletest \
    -DCMAKE_CUDA_FLAGS="${CUDA_FLAGS:-}" ${SAGE_HEAD_DIMS:+"-DSAGE_HEAD_DIMS=$SAGE_HEAD_DIMS"} -DSAGE_BUILD_TESTS=ON -DSAGE_BUILD_CLI=ON -DSAGE_BUILD_PYTHON=ON \
    -DPython_EXECUTABLE="$(python3 -c 'import sys; print(sys.executable)')" > "$OUT/build.log" 2>&1 &&
    ninja -C $BUILD -j${JOBS:-16} ${TARGETS:-} >> "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  tail -2 "$OUT/build.log"
fi
if has test; then
  log gpu tests
  # TEST_FILTER (a gtest filter) splits the suite over calls: with every head dim it runs
  # ~11 minutes on an H100, past one call's 10.
  # TEST_GROUPS="filter@seconds;filter@seconds" runs each filter under its own time limit
  # (in that order, into one log), so a hang in one group cannot take the whole call.
  groups=${TEST_GROUPS:-"${TEST_FILTER:-*}@${TEST_TIMEOUT:-300}"}
  : > "$OUT/gpu_tests.log"
  IFS=';' read -r -a group_list <<< "$groups"
  for group in "${group_list[@]}"; do
    filter=${group%@*} limit=${group##*@}
    echo "-- group $filter (limit ${limit} s)" | tee -a "$OUT/gpu_tests.log"
    (cd $BUILD && timeout "$limit" ./tests/sage_tests_gpu --gtest_filter="$filter" 2>&1) >> "$OUT/gpu_tests.log"
    echo "-- group exit $?" | tee -a "$OUT/gpu_tests.log"
  done
  grep -E "^-- group|^\[  (PASSED|FAILED)|FAILED|tests ran" "$OUT/gpu_tests.log" | tail -40
  grep -E "^\[metrics\]" "$OUT/gpu_tests.log" | awk '{print}' | sort -t'|' -k2 | tail -3
fi
if has sanitize; then
  log compute-sanitizer
  for tool in memcheck racecheck; do
    timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 $BUILD/tests/sage_tests_gpu \
      --gtest_filter="${SANITIZE_FILTER:-Sm90Sanitize.*:Sm90TwoStep.*}" \
      > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    echo "$tool exit $rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
    # The first reports on stdout too: the log itself may not come back (the 8-file limit).
    [ $rc -ne 0 ] && grep -m 12 -A2 -E "^========= (Error|Race|Warning|Invalid)" "$OUT/sanitize_$tool.log"
  done
fi
if has python; then
  log python package
  # In the build stage's folder: its library and kernels are reused, not compiled again.
  bash scripts/python_gpu_install.sh --build-dir $BUILD > "$OUT/python.log" 2>&1; echo "install exit $?"
  # PY_TESTS narrows the suite (e.g. to one file) on runs that are about something else.
  PYTHONUNBUFFERED=1 timeout 600 python3 -m pytest -q ${PY_TESTS:-tests/python} >> "$OUT/python.log" 2>&1; echo "pytest exit $?"
  tail -5 "$OUT/python.log"
fi
if has bench; then
  # BENCH_RUNS grids (default 3, ~12 s each on an H200), merged into their per-point median:
  # single grids of the same code move by up to ~9% (docs/performance.md, Protocol). The
  # runs stay in the build folder: only the merged grid goes to $OUT (its 8-file limit).
  runs=${BENCH_RUNS:-3} iters=10
  log "bench ($runs runs of the grid)"
  rm -rf $BUILD/bench_runs && mkdir -p $BUILD/bench_runs
  for i in $(seq 1 "$runs"); do
    PYTHONUNBUFFERED=1 timeout 540 python3 bench/bench_sdpa.py --iters $iters --warmup 3 \
      --json "$BUILD/bench_runs/run$i.json" --markdown "$BUILD/bench_runs/run$i.md" 2>&1 |
      grep -E "^\[[0-9]+/[0-9]+\]|Error|error" | tail -1  # the last point, with the run's seconds
  done
  if [ "$runs" -gt 1 ]; then
    python3 bench/merge_runs.py --iters $iters --json "$OUT/h100.json" --markdown "$OUT/h100.md" \
      $(seq -f "$BUILD/bench_runs/run%g.json" 1 "$runs")
  else
    cp $BUILD/bench_runs/run1.json "$OUT/h100.json" && cp $BUILD/bench_runs/run1.md "$OUT/h100.md"
    cat "$OUT/h100.md"
  fi
fi
if has recipes; then
  log "recipe speeds (sagekit alone, whole call, every preset)"
  # Only the JSON goes to $OUT (the table is printed): the 8-file limit of what comes back.
  PYTHONUNBUFFERED=1 timeout 400 python3 bench/bench_sdpa.py --recipes all --dims 64,128 \
    --ns 1024,4096,16384 --causal 0 --dtypes float16 --iters 10 --warmup 3 \
    --json "$OUT/h100_recipes.json" --markdown /dev/null 2>&1 | tail -40
fi
if has clibench; then
  log "C++ bench (sage bench, this library only)"
  timeout 300 $BUILD/cli/sage bench --d 64,128 --n 1024,4096,16384 --iters 10 --json "$OUT/clibench.json" 2>&1 | tail -20
  log "torch SDPA alone (same grid)"
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/sdpa_only.py 2>&1 | tail -20
fi
if has timingmodes; then
  log "timing modes: the protocol's synchronized calls against back-to-back calls (needs the python stage's package)"
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/timing_modes.py 2>&1 | tee "$OUT/timing_modes.txt" | tail -30
fi
if has hostbench; then
  log "host time per call (needs the python stage's package)"
  python3 bench/host_overhead.py 2>&1 | tail -14
fi
if has quickbench; then
  log quick bench
  PYTHONUNBUFFERED=1 python3 bench/bench_sdpa.py --dims 64,128 --ns 1024,4096,16384 --causal 0,1 \
    --json "$OUT/h100.json" --markdown "$OUT/h100.md" 2>&1 | tail -30
fi
if has digest; then
  # Bit-identity against an older tree in ab_old/ (an untracked copy, e.g. `git archive <commit>
  # | tar -x -C ab_old`): both trees' libraries with every kernel variant, then
  # bench/output_digest.cpp built against each, which prints a digest of the output and LSE
  # bytes of every GPU preset on eight shapes. The two listings must be equal.
  log "digest: outputs of ab_old/ and this tree, every GPU preset"
  for side in old new; do
    src=.; [ $side = old ] && src=ab_old
    (cmake -S $src -B build-digest-$side -G Ninja -DCMAKE_BUILD_TYPE=Release -DSAGE_BUILD_TESTS=OFF \
      -DSAGE_BUILD_CLI=OFF > "$OUT/digest_build_$side.log" 2>&1 &&
      ninja -C build-digest-$side -j8 sage >> "$OUT/digest_build_$side.log" 2>&1 &&
      nvcc -std=c++17 -O2 -I$src/include bench/output_digest.cpp build-digest-$side/src/libsage.a \
        -o build-digest-$side/digest >> "$OUT/digest_build_$side.log" 2>&1) &
  done
  wait
  for side in old new; do
    [ -x build-digest-$side/digest ] || { tail -20 "$OUT/digest_build_$side.log"; exit 1; }
    build-digest-$side/digest > build-digest-$side/digests.txt || exit 1
  done
  cp build-digest-new/digests.txt "$OUT/digests.txt"
  # Presets the old tree lacks have nothing to compare with: compared are the old tree's.
  awk 'NR == FNR { old[$1] = 1; next } old[$1]' build-digest-old/digests.txt \
    build-digest-new/digests.txt > build-digest-new/common.txt
  extra=$(( $(wc -l < build-digest-new/digests.txt) - $(wc -l < build-digest-new/common.txt) ))
  if diff build-digest-old/digests.txt build-digest-new/common.txt > "$OUT/digest_diff.txt"; then
    echo "digest: identical ($(wc -l < build-digest-new/common.txt) cases, $(grep -c error: build-digest-new/common.txt) refused alike; $extra of presets new here)"
  else
    echo "digest: DIFFERENT"; head -20 "$OUT/digest_diff.txt"
  fi
fi
if has ab; then
  # Speed A/B against an older tree in ab_old/: both built with only the recipe's kernels,
  # then `sage bench` of each, alternated twice in one run so that clock drift hits both
  # alike. AB_N, AB_CAUSAL (no, yes, both), AB_RECIPE, AB_DTYPE (fp16, bf16) pick the grid;
  # AB_SPLIT=1 adds `--split` (pre-pass and kernel timed alone); AB_VARIANTS the kernel
  # variants built (SAGE_KERNEL_VARIANTS, e.g. int8_dynamic:per_tile:0 for sagebwd; default
  # sage2_8b's, or all for other recipes). Lines go to $OUT/ab.txt as they come, so a run cut
  # short by its time limit still reports.
  log "A/B against ab_old/"
  recipe=${AB_RECIPE:-sage2_8b}
  variants=all; [ "$recipe" = sage2_8b ] && variants=e4m3_two_level:per_tile:0
  variants=${AB_VARIANTS:-$variants}
  for side in old new; do
    src=.; [ $side = old ] && src=ab_old
    (cmake -S $src -B build-ab-$side -G Ninja -DCMAKE_BUILD_TYPE=Release -DSAGE_BUILD_TESTS=OFF \
      -DSAGE_KERNEL_VARIANTS=$variants ${SAGE_HEAD_DIMS:+"-DSAGE_HEAD_DIMS=$SAGE_HEAD_DIMS"} \
      > "$OUT/ab_build_$side.log" 2>&1 &&
      ninja -C build-ab-$side -j8 sage_cli >> "$OUT/ab_build_$side.log" 2>&1) &
  done
  wait
  for side in old new; do
    [ -x build-ab-$side/cli/sage ] || { tail -20 "$OUT/ab_build_$side.log"; exit 1; }
  done
  for round in 1 2; do
    for side in old new; do
      echo "-- $side (round $round)" | tee -a "$OUT/ab.txt"
      timeout 300 build-ab-$side/cli/sage bench --recipe $recipe --d 64,128 --n ${AB_N:-1024,4096,16384} \
        --causal ${AB_CAUSAL:-no} --dtype ${AB_DTYPE:-fp16} --iters 20 ${AB_SPLIT:+--split} 2>&1 |
        grep -E "^ *recipe|^$recipe" | tee -a "$OUT/ab.txt"
    done
  done
  python3 bench/ab_compare.py "$OUT/ab.txt" | tee "$OUT/ab_summary.md"
fi
if has profile; then
  # Nsight Compute on one whole call of sage2_8b (the K/V pre-pass kernels and the attention
  # kernel): the full section set as text, per-pipe utilization of the attention kernel, and
  # its SASS with stall samples at d = 128, N = 16K. For docs/performance.md.
  log "ncu profile"
  NCU="ncu --clock-control none"
  PB=${PROFILE_BUILD:-$BUILD}  # e.g. build-knob-base after a knobs stage
  SAGE_BENCH="$PB/cli/sage bench --recipe sage2_8b --causal no --warmup 2 --iters 1"
  # PROFILE_POINTS: "d n;d n;..." (SASS with stall samples is exported for each).
  IFS=';' read -r -a points <<< "${PROFILE_POINTS:-128 1024;128 16384;64 16384}"
  for point in "${points[@]}"; do
    set -- $point
    timeout 200 $NCU --set full --import-source yes -k "regex:attention_kernel|kv_" \
      --launch-skip 6 --launch-count 3 -o "$PB/prof_d$1_n$2" -f \
      $SAGE_BENCH --d $1 --n $2 > /dev/null 2>&1
    ncu --import "$PB/prof_d$1_n$2.ncu-rep" --page details --print-details all \
      > "$OUT/ncu_d$1_n$2.txt" 2>&1
    ncu --import "$PB/prof_d$1_n$2.ncu-rep" --page raw --csv \
      --metrics 'regex:^sm__(inst_executed_pipe_[a-z_]+|pipe_[a-z_]+_cycles_active)\.avg\.pct_of_peak_sustained_active$' \
      >> "$OUT/ncu_d$1_n$2.txt" 2>&1
    echo "ncu d=$1 n=$2: $(grep -c 'Section:' "$OUT/ncu_d$1_n$2.txt") sections"
    ncu --import "$PB/prof_d$1_n$2.ncu-rep" --page source --print-source sass --csv \
      -k regex:attention_kernel > "$OUT/ncu_sass_d$1_n$2.csv" 2>&1
    echo "sass export: $(wc -l < "$OUT/ncu_sass_d$1_n$2.csv") lines"
    # Source lines with their SASS (needs a -lineinfo build, e.g. KNOBS="base=-lineinfo"):
    # which SASS address range is which stage of the kernel (the v13 stage profile in the
    # experiment log, docs/history/README.md).
    ncu --import "$PB/prof_d$1_n$2.ncu-rep" --page source --print-source cuda,sass --csv \
      -k regex:attention_kernel > "$OUT/ncu_src_d$1_n$2.csv" 2>&1
    echo "source export: $(wc -l < "$OUT/ncu_src_d$1_n$2.csv") lines"
  done
fi
if has dist || has distbench; then
  # Sequence parallelism (issue 37, docs/distributed.md); needs the python stage's package and
  # the engines' wheels in .whl/ (carry it). dist: the torchrun correctness tests (2 and 4
  # ranks where the GPUs exist) and the diffusers example on 2 GPUs; distbench: the scaling
  # grid for each world size in DIST_RANKS (default "2 4"), DIST_BENCH_ARGS passed on.
  bash scripts/install_dist_deps.sh .whl --target /tmp/site > "$OUT/dist.log" 2>&1 ||
    { tail -5 "$OUT/dist.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  gpus=$(nvidia-smi -L | wc -l)
fi
if has dist; then
  log sequence parallelism: tests and example on $gpus GPUs
  PYTHONUNBUFFERED=1 timeout 900 python3 -m pytest -q -rs -s tests/python/test_distributed.py \
    tests/python/test_distributed_gpu.py >> "$OUT/dist.log" 2>&1; echo "dist pytest exit $?"
  grep -E "ratio [0-9]|passed|failed|SKIPPED|Error" "$OUT/dist.log" | awk '{print}' | tail -60
  [ "$gpus" -ge 2 ] && timeout 600 torchrun --standalone --nproc-per-node 2 \
    examples/diffusers_context_parallel.py --out "$OUT/sp_example.json" 2>&1 | grep -vi warn | tail -12
fi
if has distbench; then
  for ranks in ${DIST_RANKS:-2 4}; do
    [ "$ranks" -le "$gpus" ] || { echo "distbench: $ranks ranks need $ranks GPUs (have $gpus)"; continue; }
    log sequence parallelism: scaling on $ranks GPUs
    PYTHONUNBUFFERED=1 timeout 900 torchrun --standalone --nproc-per-node "$ranks" bench/sequence_parallel.py \
      bench --out "$OUT/sp_bench_$ranks.json" ${DIST_BENCH_ARGS:-} 2>&1 | grep -E "TOPS|wrote|Error|error" | tail -80
  done
fi
if has dimbench; then
  # Issue 34's head-dim grid: every kernel tile at heads x d ~ 4096, 32K tokens a call, fp16,
  # beside torch SDPA (DIMS, NS override the dims and lengths).
  log head-dim grid
  python3 bench/bench_sdpa.py --dims "${DIMS:-64,96,128,256}" --ns "${NS:-1024,2048,4096,16384}" \
    --heads 0 --recipe "${RECIPE:-sage2_8b}" --no-kernel-only --iters ${ITERS:-10} \
    --json "$OUT/h100_dims.json" --markdown "$OUT/h100_dims.md" 2>&1 | grep -E "^\[|failed" | tail -40
fi
if has mlabench; then
  # Issue 34's MLA shape: Q/K 192 and V 128 (on the d = 256 tile), heads x 192 ~ 4096, 32K tokens
  # a call, fp16, beside torch SDPA, which takes a V head dim of its own too.
  log "MLA shape (Q/K 192, V 128)"
  python3 bench/bench_sdpa.py --dims 192 --dv 128 --ns "${NS:-1024,2048,4096,16384}" --heads 0 \
    --recipe "${RECIPE:-sage2_8b}" --no-kernel-only --iters ${ITERS:-10} \
    --json "$OUT/h100_mla.json" --markdown /dev/null 2>&1 | grep -E "^\[|failed" | tail -20
fi
if has windowbench; then
  # Issue 34's window bar: N = 32K, d = 128, causal with a 4K left window against full causal
  # (effective TOPS: visible pairs only), alternated over WINDOW_ROUNDS rounds (default 2);
  # WINDOW_VARIANTS adds "label:sage bench flags" runs, of the 4K window unless the flags give
  # another (e.g. "strided:--order strided;c4:--order consecutive --items-per-cta 4").
  # Needs the build stage's sage_cli.
  log "sliding window against full causal"
  IFS=';' read -r -a variants <<< "full:;window:--window 4096,0${WINDOW_VARIANTS:+;$WINDOW_VARIANTS}"
  rm -f $BUILD/window_*_*.json  # an earlier call's variants on a warm machine
  for round in $(seq 1 "${WINDOW_ROUNDS:-2}"); do
    for variant in "${variants[@]}"; do
      label=${variant%%:*} flags=${variant#*:}
      [ "$label" != full ] && [[ "$flags" != *--window* ]] && flags="--window 4096,0 $flags"
      $BUILD/cli/sage bench --recipe sage2_8b --d 128 --n 32768 --causal yes --split --iters 20 \
        $flags --json "$BUILD/window_${label}_$round.json" 2>&1 | grep -E "^ *sage2_8b" |
        sed "s/^/$label r$round /"
    done
  done
  # One file of records (label, round, order), and each label's median effective TOPS over
  # full causal's.
  python3 - "$OUT/h100_window.json" $BUILD/window_*_*.json <<'PY'
import json, os, re, statistics, sys
records = []
for path in sys.argv[2:]:
    label, rnd = re.match(r"window_(.+)_(\d+)\.json", os.path.basename(path)).groups()
    run = json.load(open(path))
    for r in run["records"]:
        records.append(dict(r, label=label, round=int(rnd), order=run["order"],
                            items_per_cta=run["items_per_cta"]))
json.dump(records, open(sys.argv[1], "w"), indent=1)
tops = {}
for r in records:
    tops.setdefault(r["label"], []).append(r["tops"])
full = statistics.median(tops.pop("full"))
print(f"full causal {full:.1f} TOPS (median)")
for label, values in sorted(tops.items()):
    print(f"{label}: {statistics.median(values):.1f} effective TOPS, {statistics.median(values) / full:.3f}x full causal")
PY
fi
if has varlenbench; then
  # Issue 34's packed-batch bar: 32 sequences of lengths uniform in [128, 8192], d 128.
  log packed variable-length batch
  python3 bench/bench_varlen.py --json "$OUT/h100_varlen.json" --markdown "$OUT/h100_varlen.md" 2>&1 |
    grep -vi warn | tail -20
fi
if has dimbench || has varlenbench; then
  # The record of bench/results/h100_shapes.json: both grids, with kind, d_v and window.
  python3 bench/merge_shapes.py "$OUT/h100_shapes.json" "$OUT/h100_dims.json" "$OUT/h100_varlen.json"
fi
if has bwdab; then
  # Same-run backward A/B against the tree in ab_old/ (e.g. `git archive main | tar -x -C
  # ab_old`, carried): its Python extension is built beside this one and put first on
  # PYTHONPATH, then bench_backward.py's speed grid runs old, new, old, new, so that clock drift
  # hits both alike. Needs the python stage. NS and BWD_ARGS as for bwdbench.
  log "backward A/B against ab_old/"
  cmake -S ab_old -B build-ab-old-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DSAGE_BUILD_TESTS=OFF \
    -DSAGE_BUILD_CLI=OFF -DSAGE_BUILD_PYTHON=ON ${SAGE_HEAD_DIMS:+"-DSAGE_HEAD_DIMS=$SAGE_HEAD_DIMS"} \
    -DPython_EXECUTABLE="$(python3 -c 'import sys; print(sys.executable)')" > "$OUT/ab_build_old.log" 2>&1 &&
    ninja -C build-ab-old-py -j${JOBS:-16} _C >> "$OUT/ab_build_old.log" 2>&1 || { tail -30 "$OUT/ab_build_old.log"; exit 1; }
  rm -rf /tmp/sk_old && mkdir -p /tmp/sk_old && cp -r ab_old/python/sagekit /tmp/sk_old/ &&
    cp "$(find build-ab-old-py -name '_C*.so' | head -1)" /tmp/sk_old/sagekit/
  for round in 1 2; do
    for side in old new; do
      path=; [ $side = old ] && path=/tmp/sk_old
      echo "-- $side (round $round)"
      PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH} python3 bench/bench_backward.py \
        --json "build-ab-old-py/bwdab_${side}_$round.json" --ns "${NS:-1024,4096,16384}" ${BWD_ARGS:-} 2>&1 |
        grep -vi warn | grep -E "sagekit|^ *d " | tail -40
    done
  done
  python3 - build-ab-old-py <<'PY'
import json, sys, statistics, collections
out = sys.argv[1]
ms = collections.defaultdict(list)
for side in ("old", "new"):
    for r in (1, 2):
        for rec in json.load(open(f"{out}/bwdab_{side}_{r}.json")):
            if rec.get("impl", "").startswith("sagekit"):
                ms[(rec["d"], rec["causal"], rec["n"], rec["pass"], side)].append(rec["ms"])
keys = sorted({k[:4] for k in ms})
print("d causal n pass: old ms / new ms = speed-up (median of 2 rounds each)")
ratios = []
for k in keys:
    o, n = statistics.median(ms[k + ("old",)]), statistics.median(ms[k + ("new",)])
    ratios.append(o / n)
    print(*k, f"{o:.3f} / {n:.3f} = {o / n:.3f}x")
print(f"geomean {statistics.geometric_mean(ratios):.3f}x over {len(ratios)} points")
PY
fi
if has bwdbench; then
  # Issue 33: SageBwd's gradients against float64 beside SDPA bf16, and fwd/bwd/fwd+bwd speed.
  # The GPU rows only: the simulator's (the INT8-dP ablation) are the same on any machine.
  # BWD_ARGS is passed on (e.g. --rerun, --deterministic, --recipe sagebwd_block).
  log backward accuracy and speed
  python3 bench/bench_backward.py --accuracy-json "$OUT/backward_accuracy.json" \
    --accuracy-impls sagekit,torch-sdpa-bf16 \
    --json "$OUT/h100_backward.json" --ns "${NS:-1024,2048,4096,8192,16384}" ${BWD_ARGS:-} 2>&1 | grep -vi warn | tail -40
fi
if has parity; then
  # Issue 33's training parity: a small GPT, SDPA bf16 against sagebwd (PARITY_ARGS passed on).
  log training parity
  python3 bench/training_parity.py --out "$OUT/training_parity.json" ${PARITY_ARGS:-} 2>&1 | tail -30
fi
if has bwdprofile; then
  # Nsight Compute on SageBwd's backward kernel (one fwd + bwd of sageattn, recipe sagebwd,
  # bf16, 32K tokens a call): the full section set, per-pipe utilization and the SASS with
  # stall samples, per BWD_PROFILE_POINTS ("d n causal;..."), archived into one file
  # ($OUT/bwd_profile.tgz: the per-call file limit). Source lines need CUDA_FLAGS=-lineinfo.
  log "ncu profile of the backward"
  mkdir -p $BUILD/bwdprof && rm -f $BUILD/bwdprof/*
  IFS=';' read -r -a points <<< "${BWD_PROFILE_POINTS:-128 4096 0;64 4096 0}"
  for point in "${points[@]}"; do
    set -- $point
    name=bwd_d$1_n$2_c$3
    timeout 240 ncu --clock-control none --set full --import-source yes -k regex:backward_kernel \
      --launch-skip 1 --launch-count 1 -o "$BUILD/bwdprof/$name" -f \
      python3 bench/bench_backward.py --profile-call "$1,$2,$3" > "$BUILD/bwdprof/$name.log" 2>&1
    ncu --import "$BUILD/bwdprof/$name.ncu-rep" --page details --print-details all > "$BUILD/bwdprof/$name.txt" 2>&1
    ncu --import "$BUILD/bwdprof/$name.ncu-rep" --page raw --csv \
      --metrics 'regex:^sm__(inst_executed_pipe_[a-z_]+|pipe_[a-z_]+_cycles_active)\.avg\.pct_of_peak_sustained_active$' \
      >> "$BUILD/bwdprof/$name.txt" 2>&1
    ncu --import "$BUILD/bwdprof/$name.ncu-rep" --page source --print-source cuda,sass --csv \
      -k regex:backward_kernel > "$BUILD/bwdprof/$name.sass.csv" 2>&1
    echo "$name: $(grep -c 'Section:' "$BUILD/bwdprof/$name.txt") sections, $(wc -l < "$BUILD/bwdprof/$name.sass.csv") SASS lines;" \
      "$(grep -E '^\s+Duration|Compute \(SM\) Throughput|Registers Per Thread' "$BUILD/bwdprof/$name.txt" | tr -s ' ' | tr '\n' ';')"
  done
  tar czf "$OUT/bwd_profile.tgz" -C $BUILD/bwdprof $(cd $BUILD/bwdprof && ls *.txt *.csv *.log)
fi
