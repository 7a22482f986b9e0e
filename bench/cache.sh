#!/usr/bin/env bash
# The response cache's gain (issue 12): `mlp` and an identical `mlp_cached` (response_cache { enable: true })
# served by one `fleet up --cache-config local,size=...`, measured by perf_analyzer at C=1, interleaved.
# perf_analyzer sends the same input every request, so every request to mlp_cached but the first is a hit.
#
# Usage: bench/cache.sh [OUTDIR]      env: PASSES=3  PORT=18100  INTERVAL_MS=3000
# Needs model_repository/mlp/1/model.pt (make models). Starts and stops its own fleet (by PID); 127.0.0.1 only.
set -uo pipefail
BENCH=$(dirname "$(realpath "$0")"); ROOT=$(dirname "$BENCH")
OUT=$(realpath -m "${1:-$ROOT/bench/out/cache-$(date +%H%M%S)}"); mkdir -p "$OUT"
PA=${PERF_ANALYZER:-$ROOT/.tools/perf_analyzer/perf_analyzer}
P=${PORT:-18100}; PASSES=${PASSES:-3}; INTERVAL_MS=${INTERVAL_MS:-3000}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo"
cp -r "$ROOT/model_repository/mlp" "$WORK/repo/mlp"
cp -r "$ROOT/model_repository/mlp" "$WORK/repo/mlp_cached"
sed -i 's/name: "mlp"/name: "mlp_cached"/' "$WORK/repo/mlp_cached/config.pbtxt"
echo 'response_cache { enable: true }' >> "$WORK/repo/mlp_cached/config.pbtxt"

cd "$ROOT"
# exec: $! is fleet up itself, so the TERM below reaches it (it then stops its gateway, workers and Redis).
(exec .venv/bin/python -m fleet up --model-repository "$WORK/repo" --http-port "$P" --metrics-port $((P + 2)) \
  --grpc-port $((P + 1)) --data-dir "$WORK/data" --cache-config local,size=104857600 > "$OUT/fleet.log" 2>&1) &
UP=$!
for _ in $(seq 1 120); do
  curl -sf "127.0.0.1:$P/v2/models/mlp/ready" > /dev/null && curl -sf "127.0.0.1:$P/v2/models/mlp_cached/ready" > /dev/null && break
  sleep 1
done
for pass in $(seq 1 "$PASSES"); do
  for m in mlp mlp_cached; do
    timeout 120 "$PA" -m "$m" -i http -u "127.0.0.1:$P" -b 1 --concurrency-range 1 --measurement-interval "$INTERVAL_MS" \
      --stability-percentage 20 --max-trials 12 -f "$OUT/${m}_pass$pass.csv" > "$OUT/${m}_pass$pass.txt" 2>&1
    echo "pass $pass $m: $(grep -E 'Throughput' "$OUT/${m}_pass$pass.txt" | tail -1 | xargs)," \
         "$(grep -E 'p50 latency' "$OUT/${m}_pass$pass.txt" | tail -1 | xargs)"
  done
done
curl -s "127.0.0.1:$P/v2/models/mlp_cached/stats" | .venv/bin/python -c \
  "import json,sys; s=json.load(sys.stdin)['model_stats'][0]; i=s['inference_stats']; print('mlp_cached: cache_hit', i['cache_hit'], 'cache_miss', i['cache_miss'], 'executions', s['execution_count'])"
kill -TERM "$UP"; wait "$UP"
