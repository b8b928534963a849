#!/usr/bin/env bash
# Checks that every #include points down the layers: a directory of src/ (and the public
# header of include/blade/ it implements) includes only headers of its own directory or of
# a lower layer, the core library includes no HTTP library at all, and examples/ includes
# public headers only. Prints any violation, then what each directory includes from outside
# itself; exits 1 on a violation. ctest runs it as test_layers.
#   scripts/check-layers.sh [SOURCE_ROOT]
set -euo pipefail
root="${1:-$(dirname "$0")/..}"
cd "$root"

# Layers, lowest first (README.md, "Layers"). Directories on one rank may not include each
# other. Ranks 0-8 form the core library (blade_core).
declare -A rank=(
    [common]=0
    [tensor]=1
    [gguf]=2
    [kernels]=3
    [quantize]=4 [tokenizer]=4 [sampler]=4 [chat]=4
    [model]=5
    [runner]=6 [convert]=6 [bench]=6
    [engine]=7 [eval]=7
    [imatrix]=8
    [api]=9 [loadgen]=9 [semantic_cache]=9 [cluster]=9
    [server]=10 [router]=10
    [cli]=11
)
core_top=8

# The directory that implements each public header.
declare -A owner=(
    [error]=common
    [types]=tensor
    [gguf]=gguf
    [kernels]=kernels [attention]=kernels [kv_store]=kernels [kv_type]=kernels
    [quantize]=quantize
    [tokenizer]=tokenizer
    [sampler]=sampler
    [chat_template]=chat
    [model]=model [forward]=model [synth]=model [act_stats]=model
    [runner]=runner
    [convert]=convert
    [bench]=bench
    [engine]=engine [scheduler]=engine [kv_cache]=engine [stop]=engine [spec]=engine
    [eval]=eval
    [cluster_auth]=cluster [kv_wire]=cluster [kv_handoff]=cluster [disagg]=cluster [kv_transport]=cluster [etcd_client]=cluster
    [imatrix]=imatrix
    [semantic_cache]=semantic_cache
)

# Known exception, kept visible: the type table's from_float column (tensor/types.c) points
# at the block quantizers, which depend on nothing above tensor/ themselves.
allowed_upward="src/tensor/types.c:quantize/quant_blocks.h"

status=0
for d in src/*/; do
    d=$(basename "$d")
    [ -n "${rank[$d]:-}" ] || { echo "src/$d has no layer in $0"; status=1; }
done
for h in include/blade/*.h; do
    b=$(basename "$h" .h)
    [ -n "${owner[$b]:-}" ] || { echo "include/blade/$b.h has no owning directory in $0"; status=1; }
done
[ "$status" -eq 0 ] || exit 1

declare -A uses
re='^([^:]+):[0-9]+:[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)"'
while IFS= read -r line; do
    [[ $line =~ $re ]] || continue
    file=${BASH_REMATCH[1]} inc=${BASH_REMATCH[2]}
    if [[ $file == include/blade/* ]]; then
        b=${file#include/blade/}
        from=${owner[${b%.h}]}
    else
        from=${file#src/}
        from=${from%%/*}
    fi
    case "$inc" in
    blade/*) b=${inc#blade/} to=${owner[${b%.h}]:-?} ;;
    */*) to=${inc%%/*} ;;
    *) to=$from ;; # a header beside the file
    esac
    [ "$to" = "$from" ] && continue
    uses[$from]+=" $to"
    if [ "$to" = "?" ] || [ -z "${rank[$to]:-}" ]; then
        echo "VIOLATION $file includes \"$inc\", which no layer owns"
        status=1
    elif [ "${rank[$to]}" -ge "${rank[$from]}" ] && [ "$file:$inc" != "$allowed_upward" ]; then
        echo "VIOLATION $file (layer $from, rank ${rank[$from]}) includes \"$inc\" (layer $to, rank ${rank[$to]})"
        status=1
    fi
done < <(grep -rn '#[[:space:]]*include[[:space:]]*"' src include --include='*.c' --include='*.cpp' --include='*.h')

# The core library (ranks 0..core_top) must not reach an HTTP library.
for d in "${!rank[@]}"; do
    [ "${rank[$d]}" -le "$core_top" ] || continue
    if hits=$(grep -rn '#include <\(microhttpd\|curl/\)' "src/$d" 2>/dev/null); then
        echo "VIOLATION the core library includes an HTTP library: $hits"
        status=1
    fi
done

# An embedding program sees the public headers only.
if hits=$(grep -rn '#[[:space:]]*include[[:space:]]*"' examples | grep -v '"blade/'); then
    echo "VIOLATION an example includes a private header: $hits"
    status=1
fi

for d in $(for k in "${!rank[@]}"; do echo "${rank[$k]} $k"; done | sort -n | cut -d' ' -f2); do
    deps=$(tr ' ' '\n' <<<"${uses[$d]:-}" | sed '/^$/d' | sort -u | tr '\n' ' ')
    printf '%-10s rank %-2s includes from: %s\n' "$d" "${rank[$d]}" "${deps:-(nothing)}"
done
if [ "$status" -eq 0 ]; then
    echo "OK: every include points to the same or a lower layer (exception: $allowed_upward);"
    echo "    no directory of the core library includes <microhttpd.h> or <curl/...>;"
    echo "    examples/ includes public headers (blade/...) only"
fi
exit "$status"
