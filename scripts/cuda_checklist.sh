#!/usr/bin/env bash
# The CUDA checklist (../shared/GPU.md) on a GPU machine, from the source tree, in parts that
# each end inside a device call's ten minutes:
#
#   bash scripts/cuda_checklist.sh checks OUT   # versions, the cuda tests, the whole suite (~4 min)
#   bash scripts/cuda_checklist.sh parity OUT   # fm-parity --device cuda, 12 workers sharing the GPU
#   bash scripts/cuda_checklist.sh bench OUT    # fm-bench headline + protocols, start-up, serving demo, host lengths
#   bash scripts/cuda_checklist.sh extra OUT    # the mutation check on CUDA, fm-bench's sweeps
#   bash scripts/cuda_checklist.sh "headline inplace parity_spec" OUT   # named steps, in order
#
# A part is a list of steps; the first argument may also name steps (and parts) one by one,
# so one device call can take the steps that matter most first. Steps: versions, cuda_tests,
# suite, parity, parity_spec (spec decode, the spec payloads and spec MIXED, both spec kernels), headline,
# protocols, startup, serve, host_lengths, inplace (each op's compiled kernels and HLO),
# host_path (where the class's host time goes), packed_layout (spec extras in one row per
# slot: kernels), engine_step, one_row (one-row ops and engine-owned relay buffers: compiled
# ops, host and waited time), confidence (the confidence ring's read with its copy not done:
# host time, both twins), mutations, sweeps, gemma_random (fm-serve-bench: the Gemma 3 270M
# architecture with random bfloat16 weights, sync vs overlap at B = 8, 32, 128; needs no
# weights package, gguf or tokenizer; not in a part, name it).
#
# Every step has its own time limit (seconds, overridable as LIMIT_<step>=N) and writes
# OUT/<step>.log (parity with its progress bar, so a step stopped at its limit shows how far it
# got); its exit status and wall time go to OUT/status.txt (124: out of time). A failed step
# does not stop the next. Result files are named with `cuda` (fm-bench names them by JAX's
# platform, `gpu`). PYTHON picks the interpreter (default python3).
set -uo pipefail
parts=${1:?a part (checks, parity, bench, extra) or step names}
out=$(mkdir -p "${2:?output folder}" && cd "$2" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the twins and test workers share one GPU
export py=${PYTHON:-python3}

step() {  # step NAME DEFAULT_LIMIT_S COMMAND...
    local name=$1 limit_var="LIMIT_$1" t0=$SECONDS
    local limit=${!limit_var:-$2}
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)" | tee -a "$out/status.txt"
}

versions() {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$py" - <<'EOF'
import platform, jax, numpy, torch
print("python", platform.python_version(), "numpy", numpy.__version__)
print("jax", jax.__version__, jax.devices(), "backend", jax.default_backend())
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
EOF
}

export -f versions  # run by `timeout` in a child bash

# fm-bench writes <name>_<platform>.{md,json} (JAX's platform: gpu); the results are named cuda.
moved() {  # moved DIR NAME: DIR/NAME_*.{md,json} -> OUT/NAME_cuda.*, DIR removed
    local f
    for f in "$1/$2"_*.md "$1/$2"_*.json; do
        [ -f "$f" ] && mv "$f" "$out/$2_cuda.${f##*.}"
    done
    rm -rf "$1"
}

run_step() {
    case $1 in
    versions) step versions 60 bash -c versions ;;
    cuda_tests) step cuda_tests 90 "$py" -m pytest -m cuda -rs -p no:cacheprovider ;;
    suite) step suite 360 "$py" -m pytest -n 12 -rfs -p no:cacheprovider ;;
    parity)
        step parity 420 "$py" -m fm_parity.cli --device cuda --jobs 12 --json "$out/parity_cuda.json"
        ;;
    parity_spec)
        step parity_spec 150 "$py" -m fm_parity.cli --device cuda --jobs 6 \
            --scenario spec_decode --scenario spec_sglang_eagle --scenario spec_ngram --scenario spec_mixed \
            --json "$out/parity_spec_cuda.json"
        ;;
    headline)
        step headline 120 "$py" -m fm_bench.cli --headline-only --out "$out/headline"
        mv "$out/headline/results.md" "$out/headline_cuda.md"
        mv "$out/headline/results.json" "$out/headline_cuda.json"
        rm -rf "$out/headline"
        ;;
    protocols)
        step protocols 200 "$py" -m fm_bench.cli --protocols-only --out "$out/protocols"
        moved "$out/protocols" protocols
        ;;
    startup)
        step startup 150 "$py" -m fm_bench.startup --runs 1 --maps plain spec spec_pallas debug \
            --json "$out/startup_cuda.json"
        ;;
    serve) step serve 90 "$py" -m fm_serve.cli --out "$out" --tag cuda ;;
    host_lengths)
        step host_lengths 45 "$py" -m fm_bench.host_lengths --out "$out/host_lengths"
        moved "$out/host_lengths" host_lengths
        ;;
    inplace) step inplace 90 "$py" -m fm_bench.inplace --out "$out" --tag cuda --hlo "$out/hlo" ;;
    host_path) step host_path 90 "$py" -m fm_bench.host_path --out "$out" --tag cuda ;;
    packed_layout) step packed_layout 60 "$py" -m fm_bench.packed_layout --out "$out" --tag cuda ;;
    engine_step) step engine_step 120 "$py" -m fm_bench.engine_step --out "$out" --tag cuda ;;
    one_row) step one_row 90 "$py" -m fm_bench.one_row --json "$out/one_row_cuda.json" ;;
    confidence) step confidence 90 "$py" -m pytest -s -p no:cacheprovider tests/test_confidence_cuda.py ;;
    mutations)
        step mutations 280 "$py" -m fm_parity.cli --device cuda --mutations --dtype int32 \
            --json "$out/mutations_cuda.json"
        ;;
    sweeps) step sweeps 300 "$py" -m fm_bench.cli --no-startup --no-protocols --out "$out/sweeps" ;;
    gemma_random)
        step gemma_random 240 "$py" -m fm_serve.gemma.bench --random-weights --dtype bfloat16 \
            --batch-sizes 8,32,128 --max-tokens 32 --repeats 1 --max-seq-len 128 --row-tile 16 \
            --prefill-budget 256 --out "$out" --tag cuda
        ;;
    checks) for s in versions cuda_tests suite; do run_step $s; done ;;
    bench) for s in headline protocols startup serve host_lengths inplace host_path packed_layout engine_step one_row confidence; do run_step $s; done ;;
    extra) for s in mutations sweeps; do run_step $s; done ;;
    *)
        echo "unknown part or step: $1" >&2
        exit 2
        ;;
    esac
}

for p in $parts; do
    run_step "$p"
done
