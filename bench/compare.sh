#!/usr/bin/env bash
# Side by side, interleaved: real Triton in native mode, real Triton in PyTriton mode (both from the Triton
# anchor kit) and fleet (bench/served.py), one server at a time on the same port, all measured by the same
# perf_analyzer command (bench_pa.sh's) on the same two models, 'double' and 'mlp', at the same levels.
# Optionally also fleet-base: another checkout's fleet (before/after a change, in the same interleaved run),
# and floor: bench/floor.py, the least this architecture does per request (HTTP only).
#
# Usage: bench/compare.sh OUTDIR
#   env: PASSES=2            number of passes; each pass runs every system once, the order rotating per pass
#        SYSTEMS="triton-native triton-pytriton fleet"   which systems (and the order of pass 1); fleet-http is fleet
#                            measured over HTTP whatever PA_PROTOCOL says (gRPC and HTTP in one run); add fleet-base
#                            to measure the fleet of BASE_ROOT too, e.g. SYSTEMS="fleet-base fleet"
#        BASE_ROOT=          fleet-base's checkout, e.g. one made by `git worktree add ../fleet-base COMMIT`;
#                            run with its own .venv/bin/python if it has one, else this checkout's (BASE_PYTHON
#                            overrides), by this checkout's served.py on this checkout's model repositories, so
#                            only the server code differs
#        CONC="1 8 32"       concurrency levels        INTERVAL_MS=3000   perf_analyzer --measurement-interval
#        PORT=18000          HTTP port of whichever server runs (gRPC on PORT+1, fleet's metrics on PORT+2;
#                            Triton's metrics port PORT+2 is set but off)
#        PA_PROTOCOL=http    perf_analyzer -i: http, or grpc (PORT+1; native Triton then starts with GRPC=1)
#        CHECK=32            after each start, K/check_models.py PORT CHECK (answers right, also batched); 0 skips
#        DIRECT=1            run bench/direct.py once first (the in-process compute limit); 0 skips it
#        WAIT_LOAD=          e.g. 1.2: before each server start wait (at most WAIT_MAX_S=600 s) until the 1-minute
#                            load average is at or below it (the anchor's README did that); empty: no wait
#        K=../shared/anchors/triton (relative to the checkout)   ANCHOR_VENV=bench/.anchor-triton (made by
#                            K/setup.sh when missing)
# Writes OUTDIR/passN/{triton-native,triton-pytriton,fleet,fleet-base,floor}/MODEL_cC.{txt,csv} (+ load.txt;
# fleet also MODEL_cC.stats.json and fleet.log; floor floor.log; Triton's server.log under .../run/),
# OUTDIR/direct.txt, and prints every table, then the medians side by side (bench/summary.py --compare
# OUTDIR), then with fleet-base (or floor) the medians of the pairs side by side.
set -uo pipefail
BENCH=$(dirname "$(realpath "$0")"); ROOT=$(dirname "$BENCH")
[ $# -eq 1 ] || { echo "usage: bench/compare.sh OUTDIR   (env: PASSES CONC INTERVAL_MS PORT SYSTEMS BASE_ROOT DIRECT WAIT_LOAD)" >&2; exit 2; }
OUT=$(realpath -m "$1"); mkdir -p "$OUT"
K=${K:-$(realpath -m "$ROOT/../shared/anchors/triton")}
export ANCHOR_VENV=${ANCHOR_VENV:-$BENCH/.anchor-triton}
export CONC=${CONC:-1 8 32} INTERVAL_MS=${INTERVAL_MS:-3000} PA_PROTOCOL=${PA_PROTOCOL:-http}
PORT=${PORT:-18000}; PASSES=${PASSES:-2}
read -ra SYS <<< "${SYSTEMS:-triton-native triton-pytriton fleet}"
PY=$ROOT/.venv/bin/python
if [[ " ${SYS[*]} " == *" fleet-base "* ]]; then
  [ -n "${BASE_ROOT:-}" ] && [ -d "$BASE_ROOT/fleet" ] || {
    echo "fleet-base needs BASE_ROOT=<another fleet checkout> (e.g. git worktree add ../fleet-base COMMIT)" >&2; exit 2; }
  BASE_ROOT=$(realpath "$BASE_ROOT")
  if [ -x "$BASE_ROOT/.venv/bin/python" ]; then BASE_PYTHON=${BASE_PYTHON:-$BASE_ROOT/.venv/bin/python}
  else BASE_PYTHON=${BASE_PYTHON:-$PY}; fi
  echo "== fleet-base: $BASE_ROOT ($(git -C "$BASE_ROOT" log -1 --format='%h %s' 2>/dev/null)), python $BASE_PYTHON"
fi

if [ ! -f "$ANCHOR_VENV/bin/activate" ]; then
  echo "== no anchor venv at $ANCHOR_VENV: running $K/setup.sh (once)"
  "$K/setup.sh" "$ANCHOR_VENV" || { echo "anchor setup failed" >&2; exit 1; }
fi

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_quiet() {
  [ -n "${WAIT_LOAD:-}" ] || return 0
  local t0=$SECONDS
  while awk -v lim="$WAIT_LOAD" '{exit !($1 > lim)}' /proc/loadavg && (( SECONDS - t0 < ${WAIT_MAX_S:-600} )); do
    sleep 10
  done
  echo "   load1 $(cut -d' ' -f1 /proc/loadavg) after waiting $((SECONDS - t0))s (limit $WAIT_LOAD)"
}

CURRENT_RUN=""   # ANCHOR_RUN of the Triton server this script started and has not stopped yet
FLOOR_PID=""     # bench/floor.py started by this script and not stopped yet
cleanup() {
  [ -n "$CURRENT_RUN" ] && ANCHOR_RUN=$CURRENT_RUN "$K/stop_server.sh"; CURRENT_RUN=""
  [ -n "$FLOOR_PID" ] && kill "$FLOOR_PID" 2>/dev/null && wait "$FLOOR_PID"; FLOOR_PID=""
}
trap cleanup EXIT
trap 'exit 130' INT TERM

run_triton() {   # run_triton MODE DIR   (MODE: native | pytriton)
  local mode=$1 dir=$2
  export ANCHOR_RUN=$dir/run; mkdir -p "$ANCHOR_RUN"
  # Native mode serves gRPC only with GRPC=1; PyTriton mode always does (PORT+1).
  if [ "$mode" = native ]; then start=(env GRPC="$([ "$PA_PROTOCOL" = grpc ] && echo 1 || echo 0)" "$K/start_native.sh" "$PORT")
  else start=("$K/start_server.sh" "$PORT" --delay-us 100 --torch-threads 1); fi
  CURRENT_RUN=$ANCHOR_RUN
  "${start[@]}" || { echo "   $mode: server did not start (see $ANCHOR_RUN/server.log)"; CURRENT_RUN=""; return 1; }
  if [ "${CHECK:-32}" != 0 ]; then
    (source "$K/env.sh" && timeout 120 python "$K/check_models.py" "$PORT" "${CHECK:-32}") 2>&1 | tee "$dir/check.txt"
  fi
  "$K/bench_pa.sh" "$PORT" "$dir" double mlp
  "$K/stop_server.sh"; CURRENT_RUN=""
}

run_floor() {   # run_floor DIR: bench/floor.py's models, measured by the anchor's bench_pa.sh as Triton is
  local dir=$1
  [ "$PA_PROTOCOL" = http ] || { echo "   floor: HTTP only, skipped"; return 0; }
  "$PY" "$BENCH/floor.py" serve --port "$PORT" > "$dir/floor.log" 2>&1 &
  FLOOR_PID=$!
  for _ in $(seq 150); do port_busy "$PORT" && break; kill -0 "$FLOOR_PID" 2>/dev/null || break; sleep 0.2; done
  if ! port_busy "$PORT"; then
    echo "   floor: did not start (see $dir/floor.log)"; kill "$FLOOR_PID" 2>/dev/null; wait "$FLOOR_PID"; FLOOR_PID=""
    return 1
  fi
  "$K/bench_pa.sh" "$PORT" "$dir" double mlp
  kill "$FLOOR_PID"; wait "$FLOOR_PID"; FLOOR_PID=""
}

if [ "${DIRECT:-1}" != 0 ]; then
  echo "== direct in-process compute (no server)"
  "$PY" "$BENCH/direct.py" --csv "$OUT/direct.csv" | tee "$OUT/direct.txt"
fi

for ((p = 1; p <= PASSES; p++)); do
  n=${#SYS[@]}; order=()
  for ((i = 0; i < n; i++)); do order+=("${SYS[$(((i + p - 1) % n))]}"); done
  for s in "${order[@]}"; do
    dir=$OUT/pass$p/$s; mkdir -p "$dir"
    if port_busy "$PORT" || port_busy $((PORT + 1)) || port_busy $((PORT + 2)); then
      echo "port $PORT, $((PORT + 1)) or $((PORT + 2)) on 127.0.0.1 is in use: set PORT" >&2; exit 1
    fi
    echo; echo "== pass $p/$PASSES: $s on 127.0.0.1:$PORT, $PA_PROTOCOL ($(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg))"
    wait_quiet
    case $s in
      triton-native)   run_triton native "$dir" ;;
      triton-pytriton) run_triton pytriton "$dir" ;;
      floor)           run_floor "$dir" ;;
      fleet)           "$PY" "$BENCH/served.py" --port "$PORT" --conc "$CONC" --interval-ms "$INTERVAL_MS" \
                         --models "double mlp" --out "$dir" --check "${CHECK:-32}" ;;
      fleet-http)      "$PY" "$BENCH/served.py" --port "$PORT" --conc "$CONC" --interval-ms "$INTERVAL_MS" \
                         --models "double mlp" --out "$dir" --check "${CHECK:-32}" --protocol http ;;
      fleet-base)      "$PY" "$BENCH/served.py" --port "$PORT" --conc "$CONC" --interval-ms "$INTERVAL_MS" \
                         --models "double mlp" --out "$dir" --check "${CHECK:-32}" \
                         --root "$BASE_ROOT" --python "$BASE_PYTHON" ;;
      *) echo "unknown system $s (SYSTEMS: triton-native triton-pytriton fleet fleet-http fleet-base floor)" >&2
         exit 2 ;;
    esac
  done
done

echo; echo "== all tables ($OUT)"
[ -f "$OUT/direct.txt" ] && cat "$OUT/direct.txt"
"$PY" "$BENCH/summary.py" --compare "$OUT"
pair_table() {  # pair_table FIRST SECOND: the medians of two fleet systems side by side
  "$PY" - "$BENCH" "$OUT" "$1" "$2" <<'EOF'
import statistics, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from summary import print_levels, print_table, read_dir  # noqa: E402
out, cells = Path(sys.argv[2]), {}
first, second = sys.argv[3], sys.argv[4]
for system in (first, second):
    for d in sorted(out.glob(f"pass*/{system}")):
        levels = read_dir(d, ["double", "mlp"])
        if system != "fleet":
            print_levels(f"{d.parent.name} / {system}", levels)
        for lv in levels:
            if lv.infer_s is not None:
                cells.setdefault((lv.model, lv.conc), {}).setdefault(system, []).append(lv)
def median(levels, key):
    values = [getattr(lv, key) for lv in levels or [] if getattr(lv, key) is not None]
    return statistics.median(values) if values else None
rows = []
for (model, conc), by in sorted(cells.items()):
    base, new = median(by.get(first), "infer_s"), median(by.get(second), "infer_s")
    row = [model, str(conc)]
    for system, v in ((first, base), (second, new)):
        p50 = median(by.get(system), "p50_ms")
        row.append("-" if v is None else f"{v:,.0f} ({p50:.2f})" if p50 is not None else f"{v:,.0f}")
    rows.append(row + [f"{new / base:.2f}x" if base and new else "-"])
print_table(f"median over passes, {first} vs {second}, {out}",
            ["model", "C", f"{first} infer/s (p50 ms)", f"{second} infer/s (p50 ms)", f"{second}/{first}"], rows)
EOF
}
# summary.py --compare knows triton-native, triton-pytriton and fleet; the pairs get their own tables here.
[[ " ${SYS[*]} " == *" fleet-base "* ]] && pair_table fleet-base fleet
[[ " ${SYS[*]} " == *" fleet-http "* ]] && pair_table fleet-http fleet
if [[ " ${SYS[*]} " == *" floor "* ]]; then  # the architecture's floor against native Triton, and fleet against it
  [[ " ${SYS[*]} " == *" triton-native "* ]] && pair_table triton-native floor
  [[ " ${SYS[*]} " == *" fleet "* ]] && pair_table floor fleet
fi
exit 0
