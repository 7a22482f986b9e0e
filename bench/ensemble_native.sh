#!/usr/bin/env bash
# The mlp pipeline on fleet and on native Triton, interleaved (issue 13's bar: the ensemble against calling
# the three models from the client, and against the same ensemble in tritonserver).
#
#   bench/ensemble_native.sh FLEET_HOST:PORT [ensemble.py options: --conc 32 --seconds 10]
#
# FLEET_HOST:PORT is a running fleet serving model_repository (`make up`). Native Triton (the anchor kit's
# tritonserver 2.51, ../shared/anchors/triton, started here on PORT, default 18400, stopped on exit) serves
# the kit's 'mlp' (a Python-backend model computing what model_repository's TorchScript mlp does) with
# model_repository's mlp_pre, mlp_post and mlp_pipeline copied beside it unchanged. PASSES (3) rounds,
# each running bench/ensemble.py once against fleet, then once against Triton.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
K=${K:-$(realpath -m "$ROOT/../shared/anchors/triton")}
export ANCHOR_VENV=${ANCHOR_VENV:-$ROOT/bench/.anchor-triton}
FLEET=${1:?usage: bench/ensemble_native.sh FLEET_HOST:PORT [ensemble.py options]}; shift
PORT=${PORT:-18400}
PASSES=${PASSES:-3}
KIT=$(mktemp -d)
export ANCHOR_RUN=$KIT/run
trap '"$KIT/stop_server.sh" > /dev/null; rm -rf "$KIT"' EXIT
cp -r "$K"/. "$KIT"/
for m in mlp_pre mlp_post mlp_pipeline; do cp -r "$ROOT/model_repository/$m" "$KIT/native_repo/"; done
"$KIT/start_native.sh" "$PORT"
for i in $(seq 1 60); do
  [ "$(curl -s -m 2 -o /dev/null -w '%{http_code}' "127.0.0.1:$PORT/v2/models/mlp_pipeline/ready")" = 200 ] && break
  sleep 1
done
for ((p = 1; p <= PASSES; p++)); do
  echo "== pass $p: fleet ($FLEET)"
  "$ROOT/.venv/bin/python" "$ROOT/bench/ensemble.py" --url "$FLEET" --passes 1 "$@"
  echo "== pass $p: native Triton (127.0.0.1:$PORT)"
  "$ROOT/.venv/bin/python" "$ROOT/bench/ensemble.py" --url "127.0.0.1:$PORT" --passes 1 "$@"
done
