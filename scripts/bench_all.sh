#!/usr/bin/env bash
# Rerun the benchmarks that need neither the peers (.venv-peers: vLLM, llama-server) nor root,
# each writing its JSON under benchmarks/results/, then render the documentation's tables.
#   scripts/bench_all.sh             all of them, one after another (about 50 minutes on 2 cores)
#   scripts/bench_all.sh pd serving  only those (names: see RUNS below)
# The rest: scripts/bench_peers.py (peers*.json), scripts/bench_quant_quality.py (quant_perplexity.json)
# and sudo scripts/bench_multinode.py (multinode.json);
# docs/benchmarks.md gives their commands. Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

# The random checkpoints bench_peers.py would make (build/peers/ckpt-SHAPE), and the demo model.
ckpt() { $PY -c "import sys; sys.path.insert(0, 'scripts'); from peers_setup import checkpoint; print(checkpoint('$1'))"; }
demo() { $PY -c "from ppserve.server.demo import demo_model; print(demo_model())"; }

run_chunking() { $PY scripts/bench_chunking.py; }                    # ~5 min; also chunking.png, timeline.png
run_gguf_load() { $PY scripts/bench_gguf_load.py --rounds 3; }       # ~2 min
run_model() { $PY scripts/bench_model.py --threads 2 --reps 5; }     # ~2 min
run_pd() { $PY scripts/bench_pd.py; }                                # ~2 min
run_pipeline() { $PY scripts/bench_pipeline.py; }                    # ~4 min
run_serving() {                                                      # ~4 min + ~3 min
  $PY scripts/bench_serving.py --num-requests 128 --input-len 64:256 --output-len 32:128 --rounds 5
  $PY scripts/bench_serving.py --num-requests 128 --input-len 64:256 --output-len 32:128 --rounds 3 \
    --request-rate 8 --tag poisson
}
run_prefix_cache() { $PY scripts/bench_prefix_cache.py --rounds 3; } # ~17 min
run_quant() { $PY scripts/bench_quant.py; }                         # ~2 min (quant_perplexity.json: peers)
run_profile_step() {                                                 # ~5 min for the eight
  local small realistic gguf
  small="$(ckpt small)" realistic="$(ckpt realistic)" gguf="$(demo)"
  # The column before the fast paths: F.linear, and SDPA instead of the decode-attention kernel.
  PPSERVE_CPU_KERNELS=0 $PY scripts/profile_step.py --model-dir "$small" --batch 64 --context 200 --threads 2 \
    --linear-kernel torch --tag small_plain
  $PY scripts/profile_step.py --model-dir "$small" --batch 64 --context 200 --threads 2 --tag small
  $PY scripts/profile_step.py --model-dir "$small" --batch 64 --context 200 --threads 2 --dtype bfloat16 --tag small_bf16
  $PY scripts/profile_step.py --model-dir "$small" --batch 1 --context 200 --threads 2 --tag small_batch1
  $PY scripts/profile_step.py --model-dir "$realistic" --batch 16 --context 200 --threads 2 --tag realistic
  $PY scripts/profile_step.py --model-dir "$gguf" --batch 1 --context 192 --threads 2 --tag smollm2_b1
  $PY scripts/profile_step.py --model-dir "$gguf" --batch 1 --context 192 --threads 2 --quantization auto \
    --tag smollm2_b1_q4
  $PY scripts/profile_step.py --model-dir "$gguf" --batch 32 --context 240 --threads 2 --tag smollm2_b32
}

RUNS=(chunking gguf_load model pd pipeline serving prefix_cache profile_step quant)
names=("$@")
[ "${#names[@]}" -gt 0 ] || names=("${RUNS[@]}")
for name in "${names[@]}"; do
  if ! declare -F "run_$name" >/dev/null; then
    echo "bench_all: unknown benchmark '$name' (known: ${RUNS[*]})" >&2
    exit 2
  fi
done
scripts/venv.sh test,bench
for name in "${names[@]}"; do
  echo "== $name ($(date -u +%H:%M:%S))"
  "run_$name"
done
$PY scripts/bench_tables.py
