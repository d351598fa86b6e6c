#!/usr/bin/env bash
# One device call: install the carried wheels (litgpt, jsonargparse, bitsandbytes slimmed to its CUDA 13.0 library by
# benchmarks/slim_wheel.py, so that the tree and the wheels fit the 64 MiB a call carries; see benchmarks/README.md), make
# the benchmark data, then run each step named on the command line, logging everything under $OUT.
# set: steps take RUN_TIMEOUT (seconds per run, default 900) and ONLY (run names, comma-separated) from the environment.
#   steps: env | ckpt:<model> (benchmarks/make_checkpoint.py into out/ckpt/$CKPT_NAME, default tiny-llama) | gpu-tests | gpu-test:<pytest -k expression> | set:<name> (a benchmarks/run_recipes.py set) | host:<recipe> (benchmarks/host_overhead.py) |
#          vs:<run,run> (benchmarks/vs_litgpt.py --only, TinyLlama) | vs7b:<run,run> (OpenLLaMA-7B, 20 steps) |
#          attention (benchmarks/attention_bench.py: packed attention variants, forward + backward; its options from
#                     $ATTENTION_ARGS, e.g. "--only Triton --sweep --shape 32 32 128 --tokens 2048 --samples 16") |
#          lora-kernels (benchmarks/lora_kernel_bench.py: LoRA's A side, fused kernels against the torch ops) |
#          lora-mlp (benchmarks/lora_mlp_bench.py: the LoRA MLP's middle, FusedLoRAMLP's kernels against the layers apart) |
#          lora-up (benchmarks/lora_up_bench.py: LoRA's B side, kernels.lora_up_ / lora_up_backward against cuBLAS)
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCH_LOGS=recompiles,graph_breaks
BUDGET=${BUDGET:-540}   # seconds for all steps: the tarball below must still be written inside the call's limit
START=$SECONDS
RESULTS=${OUT:-out/gpu}; mkdir -p "$RESULTS"
OUT=/tmp/litft-gpu; rm -rf "$OUT"; mkdir -p "$OUT"   # work here; only a tarball and a summary go back
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
python3 benchmarks/make_bench_data.py --out out/bench-data/alpaca_like.json > "$OUT/bench-data.txt" 2>&1
python3 benchmarks/make_bench_data.py --tail10 --out out/bench-data/alpaca_tail10.json >> "$OUT/bench-data.txt" 2>&1
cat "$OUT/bench-data.txt"
status=0
for step in "$@"; do
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then echo "=== $step skipped: budget spent"; status=1; continue; fi
  echo "=== $step ($(date +%T), ${left}s left)"
  case "$step" in
    env) python3 -m litft.cli env 2>&1 | tee "$OUT/env.txt"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/env.txt" ;;
    gpu-tests) timeout "$left" python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_notebook.py 2>&1 | tee "$OUT/gpu-tests.txt" | tail -25 || status=1 ;;
    gpu-test:*) timeout "$left" python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_notebook.py -k "${step#gpu-test:}" 2>&1 \
                  | tee "$OUT/gpu-test.txt" | tail -25 || status=1 ;;
    ckpt:*) python3 benchmarks/make_checkpoint.py --model "${step#ckpt:}" --out "out/ckpt/${CKPT_NAME:-tiny-llama}" 2>&1 | tail -2 ;;
    set:*) timeout "$left" python3 benchmarks/run_recipes.py "${step#set:}" --out "$OUT/${step#set:}" --timeout "${RUN_TIMEOUT:-900}" \
             ${ONLY:+--only "$ONLY"} > "$OUT/${step#set:}.log" 2>&1 || status=1
           tail -30 "$OUT/${step#set:}.log" ;;
    host:*) timeout "$left" python3 benchmarks/host_overhead.py --recipe "${step#host:}" --out "$OUT/host" \
              2>&1 | tee "$OUT/host-${step#host:}.log" | grep -v "^ " || status=1 ;;
    vs:*) timeout "$left" python3 benchmarks/vs_litgpt.py --out "$OUT/vs-litgpt" --only "${step#vs:}" --timeout 400 \
            > "$OUT/vs-${step#vs:}.log" 2>&1 || status=1
          tail -40 "$OUT/vs-${step#vs:}.log" ;;
    vs7b:*) timeout "$left" python3 benchmarks/vs_litgpt.py --out "$OUT/vs-litgpt-7b" --model open_llama_7b \
              --max-steps "${STEPS_7B:-20}" --only "${step#vs7b:}" --timeout 300 > "$OUT/vs7b-${step#vs7b:}.log" 2>&1 || status=1
            tail -40 "$OUT/vs7b-${step#vs7b:}.log" ;;
    lora-kernels) timeout "$left" python3 benchmarks/lora_kernel_bench.py --out "$OUT/lora-kernels.md" > "$OUT/lora-kernels.log" 2>&1 || status=1
                  tail -12 "$OUT/lora-kernels.log" ;;
    lora-mlp) timeout "$left" python3 benchmarks/lora_mlp_bench.py ${MLP_SWEEP:+--sweep} --out "$OUT/lora-mlp.md" > "$OUT/lora-mlp.log" 2>&1 || status=1
              tail -12 "$OUT/lora-mlp.log" ;;
    lora-up) timeout "$left" python3 benchmarks/lora_up_bench.py --out "$OUT/lora-up.md" > "$OUT/lora-up.log" 2>&1 || status=1
             tail -12 "$OUT/lora-up.log" ;;
    attention) timeout "$left" python3 benchmarks/attention_bench.py ${ATTENTION_ARGS:-} --out "$OUT/attention.md" > "$OUT/attention.log" 2>&1 || status=1
               tail -20 "$OUT/attention.log" ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
# what comes back: one tarball (tables, logs, every run's result.json and metrics) and the tables in one summary
# (profiler traces and memory snapshots stay behind: one is tens of MB, over the 16 MiB a returned file may have;
# their top-ops tables and per-pool summaries are in each run's log.txt; so do the runs' copies of the demo tokenizer,
# which would push the tracked tree plus the carried wheels over the device tool's 64 MiB once committed)
tar czf "$RESULTS/results.tgz" -C "$OUT" --exclude='*.tfevents*' --exclude='*.pth*' --exclude='*.lora' --exclude='*.pickle' \
  --exclude='*/final/tokenizer.json' --exclude='profile' . 2>/dev/null
cat "$OUT"/env.txt "$OUT"/*/*.md "$OUT"/host-*.log "$OUT"/attention.md "$OUT"/lora-kernels.md "$OUT"/lora-mlp.md "$OUT"/lora-up.md "$OUT"/vs-litgpt/*.md "$OUT"/vs-litgpt-7b/*.md > "$RESULTS/summary.md" 2>/dev/null
exit $status
