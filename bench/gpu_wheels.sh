#!/usr/bin/env bash
# Download, here, the wheels bench/gpu_check.sh needs on the GPU box (Python 3.12, x86-64, no network there):
# the packages exl needs that the box's image lacks (/work/.library/device/KINDS.md lists what it has).
#   bash bench/gpu_wheels.sh [DIR]     # default .whl/ (git ignores it; name it in the device tool's `carry`)
# llguidance (constrained output) has no wheel for the box's platform here: the server then only warns.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
# versions as installed with exl's dev extras; one version of each
PKGS=(gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
      typing-inspection==0.4.2 uvicorn==0.55.0 sse-starlette==3.7.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 -d "$DIR" "${PKGS[@]}"
du -sh "$DIR" >&2
