#!/usr/bin/env bash
# Issue 23's interference measurement: long prompts arriving while many streams decode
# (`blade bench serve --workload long-interference`), against two setups on the same cores,
# each behind `blade router` on loopback:
#   colocated      one `blade serve` on CPUS_BOTH with THREADS_BOTH threads;
#   disaggregated  `blade serve --role prefill` on CPUS_PREFILL and `--role decode` on
#                  CPUS_DECODE, one thread each (taskset), the KV cache going over UCX.
# Prints one table side by side; the full reports (text and JSON with every request) stay in
# OUT. Every process it starts is stopped on exit, each run is bounded by RUN_TIMEOUT.
#   scripts/bench-interference.sh [colocated] [disaggregated]     (both when none is named)
# Knobs (environment): MODEL, BLADE, OUT, LOCK (a file: each setup runs under an exclusive
# flock of it, so builds and other benchmarks wait), REQUESTS, CONCURRENCY, RATE (requests a
# second, Poisson; inf: a new one as soon as one of CONCURRENCY ends), INPUT_LEN,
# OUTPUT_LEN, LONG_LEN, LONG_EVERY, SEED, KV_MEM, RUN_TIMEOUT, CPUS_BOTH, CPUS_PREFILL,
# CPUS_DECODE.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-/tmp/tl-stories-q4_0.gguf}
BLADE=${BLADE:-build/blade}
OUT=${OUT:-/tmp/blade-interference}
LOCK=${LOCK:-}
REQUESTS=${REQUESTS:-96}
CONCURRENCY=${CONCURRENCY:-10}
RATE=${RATE:-inf}
INPUT_LEN=${INPUT_LEN:-32}
OUTPUT_LEN=${OUTPUT_LEN:-128}
LONG_LEN=${LONG_LEN:-1000}
LONG_EVERY=${LONG_EVERY:-8}
SEED=${SEED:-1}
KV_MEM=${KV_MEM:-1G}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
CPUS_BOTH=${CPUS_BOTH:-0,1}
CPUS_PREFILL=${CPUS_PREFILL:-0}
CPUS_DECODE=${CPUS_DECODE:-1}

setups=("$@")
[ ${#setups[@]} -gt 0 ] || setups=(colocated disaggregated)
for s in "${setups[@]}"; do
    case "$s" in
    colocated | disaggregated) ;;
    *) echo "usage: $0 [colocated] [disaggregated]" >&2 && exit 2 ;;
    esac
done
[ -x "$BLADE" ] || { echo "error: $BLADE not built" >&2 && exit 1; }
[ -r "$MODEL" ] || { echo "error: no model at $MODEL (blade synth --shape tinyllama-1.1b ...)" >&2 && exit 1; }
mkdir -p "$OUT"

# One setup: its workers and router, the benchmark, the workers' counters; everything it
# started is stopped before it returns (or by the EXIT trap when it fails).
if [ "${BENCH_INTERFERENCE_ONE:-}" = "" ]; then
    for s in "${setups[@]}"; do
        if [ -n "$LOCK" ]; then
            BENCH_INTERFERENCE_ONE=1 flock -x "$LOCK" "$0" "$s"
        else
            BENCH_INTERFERENCE_ONE=1 "$0" "$s"
        fi
    done
    # Side by side, from the JSON reports of this run's setups.
    row() { # label, jq expression over one report; one column per setup
        local line
        line=$(printf '| %-24s' "$1")
        for s in "${setups[@]}"; do
            line+=$(printf ' | %15s' "$(jq -r "$2" "$OUT/$s.json")")
        done
        echo "$line |"
    }
    f1='def f: if . == null then "-" else (. * 10 | round / 10 | tostring) end;'
    header=$(printf '| %-24s' "")
    rule="| ------------------------"
    for s in "${setups[@]}"; do
        header+=$(printf ' | %15s' "$s")
        rule+=" | --------------:"
    done
    echo
    echo "$header |"
    echo "$rule |"
    row "ITL p50 ms" "$f1 .results.itl_ms.median | f"
    row "ITL p90 ms" "$f1 .results.itl_ms.p90 | f"
    row "ITL p99 ms" "$f1 .results.itl_ms.p99 | f"
    row "ITL max ms" "$f1 .results.itl_ms.max | f"
    row "TPOT mean ms" "$f1 .results.tpot_ms.mean | f"
    row "TTFT p50 ms" "$f1 .results.ttft_ms.median | f"
    row "TTFT p99 ms" "$f1 .results.ttft_ms.p99 | f"
    # Short and long prompts wait for different things: split TTFT by prompt length.
    row "TTFT short prompts p50" "$f1 [.requests[] | select(.failure == \"\" and .prompt_len < $LONG_LEN) | .ttft_ms] | sort | if length > 0 then .[length / 2 | floor] else null end | f"
    row "TTFT long prompts p50" "$f1 [.requests[] | select(.failure == \"\" and .prompt_len >= $LONG_LEN) | .ttft_ms] | sort | if length > 0 then .[length / 2 | floor] else null end | f"
    row "output tokens/s" "$f1 .results.output_token_throughput | f"
    row "total tokens/s" "$f1 .results.total_token_throughput | f"
    row "wall s" "$f1 .results.duration_s | f"
    row "requests ok / failed" '"\(.results.completed) / \(.results.failed)"'
    exit 0
fi

setup=${setups[0]}
pids=()
stop_all() {
    local p
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        p=${pids[i]}
        kill -TERM "$p" 2>/dev/null || continue
        for _ in $(seq 50); do
            kill -0 "$p" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    pids=()
}
trap stop_all EXIT
trap 'exit 130' INT TERM

# start NAME CPUS ARGS...: a blade process on port 0 (any free one), pinned to CPUS when given;
# sets PORT to the port it reports.
start() {
    local name=$1 cpus=$2 log="$OUT/$setup-$1.log"
    shift 2
    if [ -n "$cpus" ]; then
        taskset -c "$cpus" "$BLADE" "$@" >"$log" 2>&1 &
    else
        "$BLADE" "$@" >"$log" 2>&1 &
    fi
    pids+=($!)
    PORT=
    for _ in $(seq 100); do
        PORT=$(sed -n 's|.*listening on http://127\.0\.0\.1:\([0-9]*\).*|\1|p' "$log" | head -n 1)
        [ -n "$PORT" ] && return 0
        kill -0 "${pids[-1]}" 2>/dev/null || break
        sleep 0.1
    done
    echo "error: $name did not start; its log:" >&2
    cat "$log" >&2
    exit 1
}

# wait_ready URL PATTERN: until GET URL answers with PATTERN in its body (60 s at most).
wait_ready() {
    for _ in $(seq 600); do
        curl -sf --max-time 2 "$1" 2>/dev/null | grep -q "$2" && return 0
        sleep 0.1
    done
    echo "error: $1 never answered $2" >&2
    exit 1
}

serve=(serve -m "$MODEL" --host 127.0.0.1 --port 0 --kv-mem "$KV_MEM")
workers=()
if [ "$setup" = colocated ]; then
    start both "$CPUS_BOTH" "${serve[@]}" -t "$(($(tr -cd , <<<"$CPUS_BOTH" | wc -c) + 1))"
    workers+=("http://127.0.0.1:$PORT")
else
    start prefill "$CPUS_PREFILL" "${serve[@]}" -t 1 --role prefill
    workers+=("http://127.0.0.1:$PORT")
    start decode "$CPUS_DECODE" "${serve[@]}" -t 1 --role decode
    workers+=("http://127.0.0.1:$PORT")
fi
for w in "${workers[@]}"; do
    wait_ready "$w/health" '"ok"'
done
list=$(
    IFS=,
    echo "${workers[*]}"
)
start router "" router --listen 127.0.0.1:0 --workers "$list"
router="http://127.0.0.1:$PORT"
healthy=0
for _ in $(seq 100); do
    healthy=$(curl -sf --max-time 2 "$router/health" | grep -o '"healthy":true' | wc -l)
    [ "$healthy" -eq ${#workers[@]} ] && break
    sleep 0.1
done
[ "$healthy" -eq ${#workers[@]} ] || { echo "error: the router sees $healthy of ${#workers[@]} workers healthy" >&2 && exit 1; }

echo "== $setup: $(IFS=' '; echo "${workers[*]}") behind $router" >&2
timeout "$RUN_TIMEOUT" "$BLADE" bench serve --url "$router" --tokenizer "$MODEL" --workload long-interference \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --long-len "$LONG_LEN" --long-every "$LONG_EVERY" \
    --num-requests "$REQUESTS" --max-concurrency "$CONCURRENCY" --request-rate "$RATE" --ignore-eos --seed "$SEED" \
    --json "$OUT/$setup.json" | tee "$OUT/$setup.txt"
# Where the prompts were computed: a disaggregated run whose transfers failed would have
# prefilled on the decode worker, and would measure something else.
{
    echo "router:"
    curl -sf --max-time 2 "$router/metrics" | grep -E '^blade_router:(requests_total|disaggregated_total)' || true
    for w in "${workers[@]}"; do
        echo "$w:"
        curl -sf --max-time 2 "$w/metrics" | grep -E '^blade:(remote_prefills_total|prefill_service_served_total)' || true
    done
} | tee "$OUT/$setup-metrics.txt"
