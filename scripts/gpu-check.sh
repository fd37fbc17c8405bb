#!/usr/bin/env bash
# The prepared GPU check (issue 31 item 5; docs/gpu.md): packserve on an NVIDIA card in minutes,
# on a machine with no package registry and at most 64 MiB copied to it.
#
#   scripts/gpu-check.sh --prepare DIR   (a connected machine, in a packserve checkout) build DIR,
#       under 64 MiB: the wheels packserve's server and the check need that the GPU machine
#       lacks (CPython 3.12, manylinux x86_64; not torch, nvidia-*, numpy or llama-cpp-python),
#       packserve's own wheel and source (its gpu tests), llama-server built for CUDA sm_90
#       (PACKSERVE_CUDA_ARCH) with setup.sh's flags and patches, xz-compressed, and this check.
#       Prints DIR's size and fails over 64 MiB.
#   DIR/gpu-check.sh --prepared DIR      (the GPU machine: python3 3.12 with torch+CUDA,
#       nvidia-ml-py and sentence-transformers, itself a venv; no registry) a venv that sees
#       python3's packages through a .pth, the wheels installed into it (--no-index), llama-server
#       behind a wrapper that sets its libraries; then scripts/gpu/check.py: the models (a
#       Llama-3.2-1B-shaped GGUF, a BERT) served on cuda:0, measured, each step in its seconds.
#       Everything ends inside PACKSERVE_GPU_CHECK_SECONDS (570: one device command of 600 s);
#       report.json, report.txt and logs.tar.xz go to $OUT when it is set, else DIR/report.
#       PACKSERVE_GPU_CHECK_ARGS: more words for check.py (e.g. --only environment,serve).
#   scripts/gpu-check.sh --dry-run [DIR] (any machine, in a checkout with .venv) every step that
#       needs no card: the fake-CUDA tests, the tiny models (the GGUF in the CPU llama-server,
#       the BERT in sentence-transformers on the CPU), DIR's size; then fails saying no NVIDIA
#       driver was found (or says the driver is there: run --prepared). After a setup without
#       --dev it names the steps it skips (no pytest, no sentence-transformers).
set -euo pipefail

limit=$((64 * 1024 * 1024))
say() { echo "gpu-check: $*" >&2; }
fail() { say "$*"; exit 1; }
usage() { echo "usage: scripts/gpu-check.sh --prepare [--no-compile] DIR | --prepared DIR | --dry-run [DIR]" >&2; exit 2; }
[ $# -ge 1 ] || usage
mode=$1
shift
# --no-compile before or after DIR; anything else left over is refused, never ignored (a
# mistyped flag would otherwise start the hour-long CUDA build)
no_compile=false
dir=
for arg in "$@"; do
  case "$arg" in
    --no-compile) [ "$mode" = --prepare ] || { say "--no-compile goes with --prepare"; usage; }
                  no_compile=true ;;
    -*) say "unknown option $arg"; usage ;;
    *) [ -z "$dir" ] || { say "one DIR, not '$dir' and '$arg'"; usage; }
       dir=$arg ;;
  esac
done
case "$mode" in
  --prepare|--prepared) [ -n "$dir" ] || usage ;;
  --dry-run) ;;
  *) usage ;;
esac

# What the GPU machine has, and so is not shipped: torch and NVIDIA's libraries, numpy (torch,
# transformers), nvidia-ml-py, sentence-transformers and what comes with them
# (huggingface_hub, safetensors, tokenizers); llama.cpp runs as the llama-server runner, so no
# llama-cpp-python either.
ship=(fastapi uvicorn httptools pydantic httpx orjson rich prometheus-client jsonschema gguf)
test_tools=(pytest)
target_has='^(numpy|torch|triton|nvidia[-_].*|nvidia-ml-py|safetensors|huggingface[-_]hub|tokenizers|transformers|sentence[-_]transformers)-'
# CUDA 13.0's cuBLAS, for a toolkit installed without it (the build machines'): the toolkit's own
# major and minor, so the binary asks nothing of a newer one; the GPU machine's comes with torch.
cublas_pin=nvidia-cublas==13.0.2.14

size_of() { du -sb "$1" | cut -f1; }
check_size() {
  local bytes
  bytes=$(size_of "$1")
  echo "gpu-check: $1 holds $bytes bytes ($((bytes / 1024 / 1024)) MiB; the limit is 64 MiB)"
  [ "$bytes" -le "$limit" ] || { say "$1 is over 64 MiB ($bytes bytes)"; return 1; }
}

driver_answers() {
  command -v nvidia-smi >/dev/null 2>&1 \
    && nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader >/dev/null 2>&1
}

# --- the CUDA toolkit's missing pieces, for the compile here ------------------------------------
# cuBLAS from PyPI (headers, libcublas.so.13) and, where the toolkit has no stubs/, a libcuda.so
# stub with the driver API's names (soname libcuda.so.1) so that the link resolves: the real
# libcuda.so.1 is the driver's, loaded on the GPU machine at run time. Kept in a scratch prefix,
# never in .venv; CMake finds them through CPATH and CMAKE_LIBRARY_PATH.
cuda_overlay() {
  local cuda=${PACKSERVE_CUDA_HOME:-/usr/local/cuda} overlay=$1 py=$2
  [ -f "$cuda/include/cublas_v2.h" ] && { [ -e "$cuda/lib64/stubs/libcuda.so" ] \
    || [ -e "$cuda/lib64/libcuda.so" ]; } && return 0
  mkdir -p "$overlay/include" "$overlay/lib"
  if [ ! -f "$cuda/include/cublas_v2.h" ] && [ ! -e "$overlay/lib/libcublas.so" ]; then
    say "the CUDA toolkit in $cuda has no cuBLAS: $cublas_pin from PyPI into $overlay"
    rm -rf "$overlay/wheel" && mkdir -p "$overlay/wheel"
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$overlay/wheel" "$cublas_pin"
    (cd "$overlay/wheel" && "$py" -m zipfile -e ./*.whl .)
    local lib inc
    lib=$(dirname "$(find "$overlay/wheel" -name 'libcublas.so.*' | head -1)")
    inc=$(dirname "$(find "$overlay/wheel" -name cublas_v2.h | head -1)")
    ln -sf "$inc"/*.h "$overlay/include/"
    for so in libcublas libcublasLt; do
      ln -sf "$lib/$so.so.13" "$overlay/lib/$so.so.13"
      ln -sf "$so.so.13" "$overlay/lib/$so.so"
    done
  fi
  if [ ! -e "$cuda/lib64/stubs/libcuda.so" ] && [ ! -e "$cuda/lib64/libcuda.so" ] \
      && [ ! -e "$overlay/lib/libcuda.so" ]; then
    say "no libcuda.so stub in $cuda: one made from cuda.h's names into $overlay/lib"
    echo '#include <cuda.h>' | gcc -E -I"$cuda/include" -x c - | tr '\n' ' ' \
      | grep -oP '\bCUresult\s+\K(cu\w+)(?=\s*\()' | sort -u \
      | sed 's/.*/int &(void) { return 999; }/' > "$overlay/libcuda-stub.c"
    gcc -shared -fPIC -o "$overlay/lib/libcuda.so" -Wl,-soname,libcuda.so.1 "$overlay/libcuda-stub.c"
  fi
  export CPATH="$overlay/include${CPATH:+:$CPATH}"
  export CMAKE_LIBRARY_PATH="$overlay/lib${CMAKE_LIBRARY_PATH:+:$CMAKE_LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$overlay/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# --- --prepare --no-compile: llama.cpp's source for a build on the card ---------------------------
# The llama-cpp-python sdist setup.sh builds from (76.6 MB, over what a call carries), patched
# here as setup.sh patches it, trimmed to what llama-server needs: ggml with its CPU and CUDA
# parts, src, include, common, vendor, tools (each tool's CMakeLists is read at configure time)
# without the web UI's sources, the server's tests and the other backends. 3.8 MB xz (0.3.36).
llama_version() {
  local v
  v=$(scripts/setup.sh --plan 2>/dev/null | sed -n 's/^llama.cpp source: llama-cpp-python \([^ ]*\) sdist$/\1/p')
  [ -n "$v" ] || v=$(sed -n 's/^llama-cpp-python==//p' requirements.txt)
  [ -n "$v" ] || fail "no llama-cpp-python version: neither setup.sh --plan nor requirements.txt names one"
  echo "$v"
}

llama_tree() {
  local arch=$1 version src flags
  version=$(llama_version)
  flags=$(PACKSERVE_DEVICE=cuda PACKSERVE_CUDA_ARCH=$arch scripts/setup.sh --plan | sed -n 's/^llama-server: //p')
  [ -n "$flags" ] || fail "setup.sh --plan names no llama-server flags for CUDA sm_$arch"
  src=$(mktemp -d "${TMPDIR:-/tmp}/packserve-gpu-llama.XXXXXX")
  say "llama.cpp $version's source (the llama-cpp-python sdist), patched and trimmed"
  "$py" -m pip download -q --disable-pip-version-check --no-cache-dir --no-deps \
    --no-binary llama-cpp-python -d "$src" "llama-cpp-python==$version"
  tar -xzf "$src/llama_cpp_python-$version.tar.gz" -C "$src"
  local root=$src/llama_cpp_python-$version p
  for p in scripts/patches/llama-cpp-python-*.patch scripts/patches/llama-server-*.patch; do
    patch -p1 --forward --fuzz=0 --quiet -d "$root" < "$p"
  done
  tar -C "$root/vendor/llama.cpp" -cf - \
    --exclude='ggml/src/ggml-'{blas,cann,et,hip,metal,musa,rpc,virtgpu,sycl,vulkan,webgpu,zdnn,opencl,hexagon,zendnn,openvino} \
    --exclude='tools/ui/'{src,static,tests,scripts,'*.json','*.ts','*.js'} \
    --exclude='tools/server/'{tests,bench} --exclude='*.md' \
    CMakeLists.txt LICENSE cmake common ggml include src tools vendor scripts/ui-assets.cmake \
    | xz -9 -T0 > "$dir/llama.cpp.tar.xz"
  rm -rf "$src"
  mkdir -p "$dir/llama-build"
  echo "$version" > "$dir/llama-build/version"
  echo "$flags -G Ninja" > "$dir/llama-build/cmake-flags"
  (cd scripts/patches && sha256sum llama-cpp-python-*.patch llama-server-*.patch) > "$dir/llama-build/patches.sha256"
  say "llama.cpp.tar.xz: $(size_of "$dir/llama.cpp.tar.xz") bytes"
}

prepare() {
  cd "$(dirname "$0")/.."
  local py=$PWD/.venv/bin/python
  [ -x "$py" ] || py=python3
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  rm -rf "$dir/wheels" "$dir/gpu" "$dir/src.tar.xz" "$dir/llama-server.xz" "$dir/lib.tar.xz" \
    "$dir/report" "$dir/llama.cpp.tar.xz" "$dir/llama-build"
  mkdir -p "$dir/wheels" "$dir/gpu"

  local arch=${PACKSERVE_CUDA_ARCH:-90} overlay server
  if $no_compile; then
    llama_tree "$arch"
  else
  # llama-server for the card: setup.sh's own build (same flags, patches and cache) with CUDA
  overlay=${PACKSERVE_CUDA_OVERLAY:-${XDG_CACHE_HOME:-$HOME/.cache}/packserve/cuda-overlay}
  cuda_overlay "$overlay" "$py"
  say "llama-server for CUDA sm_$arch (scripts/setup.sh --server-only; a first build takes long)"
  server=$(PACKSERVE_DEVICE=cuda PACKSERVE_CUDA_ARCH=$arch scripts/setup.sh --server-only) \
    || fail "the CUDA build of llama-server failed"
  strip -o "$dir/llama-server" "$server"
  xz -9e -T0 -f "$dir/llama-server"
  # the C++ runtime it was linked with, used on the GPU machine only where its own is missing
  # or older (ldd says "not found"): OpenMP's libgomp, libstdc++ and libgcc_s
  local so
  mkdir -p "$dir/lib.partial"
  for so in libgomp.so.1 libstdc++.so.6 libgcc_s.so.1; do
    cp "$(readlink -f "$(gcc -print-file-name="$so")")" "$dir/lib.partial/$so"
  done
  tar -C "$dir/lib.partial" -cJf "$dir/lib.tar.xz" .
  rm -rf "$dir/lib.partial"
  fi

  # the wheels for CPython 3.12 on manylinux x86_64, at requirements.txt's pins
  local reqs=() name pin
  for name in "${ship[@]}"; do
    pin=$(grep -iE "^${name}==" requirements.txt) || fail "requirements.txt pins no $name"
    reqs+=("$pin")
  done
  for name in "${test_tools[@]}"; do
    pin=$(grep -ihE "^${name}==" requirements-dev.txt) || pin=$name
    reqs+=("$pin")
  done
  say "wheels for CPython 3.12: ${reqs[*]}"
  "$py" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d "$dir/wheels" "${reqs[@]}"
  find "$dir/wheels" -maxdepth 1 -name '*.whl' -printf '%f\n' | grep -iE "$target_has" \
    | while read -r w; do rm -f "$dir/wheels/$w"; done
  printf '%s\n' "${reqs[@]}" > "$dir/wheels/requirements.txt"

  # packserve's source (what git tracks or would: its gpu tests run from it on the card), and
  # its wheel, built from that copy so that nothing is written into this checkout
  local files=(src tests scripts/gpu scripts/gpu-check.sh pyproject.toml README.md) build
  git ls-files -z -co --exclude-standard -- "${files[@]}" | tar --null -T - -cJf "$dir/src.tar.xz"
  build=$(mktemp -d "${TMPDIR:-/tmp}/packserve-gpu-wheel.XXXXXX")
  tar -xJf "$dir/src.tar.xz" -C "$build"
  # with build isolation: pyproject's SPDX `license = "Apache-2.0"` (PEP 639) needs setuptools
  # 77 or newer, and a Python 3.11 venv has 65.5; pip fetches a current one for the build
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$dir/wheels" "$build" >/dev/null
  rm -rf "$build"
  # the check and this script, and llama.cpp's router as the check's peer (benchmarks/router.py)
  cp scripts/gpu/*.py "$dir/gpu/"
  mkdir -p "$dir/gpu/benchmarks"
  cp benchmarks/__init__.py benchmarks/common.py benchmarks/router.py "$dir/gpu/benchmarks/"
  cp scripts/gpu-check.sh "$dir/gpu-check.sh"
  {
    echo "prepared: $(date -u +%FT%TZ) on $(uname -n) from packserve $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tests scripts || echo ' (with changes)')"
    echo "llama-server: CUDA sm_$arch, $(PACKSERVE_DEVICE=cuda PACKSERVE_CUDA_ARCH=$arch scripts/setup.sh --plan 2>/dev/null | sed -n 's/^llama-server: //p')"
    if $no_compile; then
      echo "llama-server: built on the card from llama.cpp.tar.xz (llama.cpp $(cat "$dir/llama-build/version"), patched here)"
    else
      echo "llama-server sha256 (unpacked): $(sha256sum "$server" | cut -d' ' -f1) (before strip)"
    fi
    (cd "$dir" && find . -type f ! -name MANIFEST.txt -printf '%s %p\n' | sort -k2)
  } > "$dir/MANIFEST.txt"
  check_size "$dir" || exit 1
  say "prepared; on the card (docs/gpu.md): $(basename "$dir")/gpu-check.sh --prepared $(basename "$dir")"
}

# --- on the GPU machine ------------------------------------------------------------------------
# Each environment step runs alone, its output in logs/NAME.log and its verdict in
# logs/env-steps.txt; a failed one is fatal (nothing after it could measure the card), and the
# EXIT trap still leaves a report. Where $OUT is set (the device tool brings back only what is
# under it: at most 8 files of 16 MiB), report.json, report.txt and logs.tar.xz go there.
env_step() {
  local name=$1 t0=$SECONDS rc=0
  shift
  say "$name"
  set +e
  ( set -e; "$@" ) >>"$logs/$name.log" 2>&1
  rc=$?
  set -e
  if [ "$rc" -eq 0 ]; then
    echo "$name ok $((SECONDS - t0))" >>"$logs/env-steps.txt"
    return 0
  fi
  echo "$name FAILED $((SECONDS - t0))" >>"$logs/env-steps.txt"
  tail -n 25 "$logs/$name.log" >&2
  fail "$name failed (exit $rc); its log: $logs/$name.log"
}

finish() {
  local rc=$?
  trap - EXIT TERM INT
  # check.py ends its own processes; this is for a kill between two of its steps
  if [ -n "${check_pid:-}" ] && kill -TERM "$check_pid" 2>/dev/null; then
    local i
    for i in $(seq 30); do kill -0 "$check_pid" 2>/dev/null && sleep 0.5 || break; done
  fi
  "$py" "$dir/gpu/box.py" env-report "$report" "$logs/env-steps.txt" || true
  "$py" "$dir/gpu/box.py" pack-logs "$logs" "$report/logs.tar.xz" 4 || true
  say "report: $report/report.json, report.txt, logs.tar.xz (exit $rc; $((SECONDS - t_start)) s)"
  exit "$rc"
}

# the machine's python3 (PYTHON names another) is a venv itself: this venv sees its packages
# through a .pth of site.addsitedir lines (not --system-site-packages, which would give the
# *base* interpreter's), and installs what the wheels add at the pins, --no-index
make_venv() {
  rm -rf "$venv"
  "$py" -m venv --without-pip "$venv"
  local purelib
  purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$py" "$dir/gpu/box.py" site-dirs >"$purelib/packserve-gpu-check-parent.pth"
  cat "$purelib/packserve-gpu-check-parent.pth"
  "$venv/bin/python" -c 'import numpy, pip; print("numpy", numpy.__version__, "pip", pip.__version__)'
}

install_wheels() {
  local pipv=("$venv/bin/python" -m pip --disable-pip-version-check --no-input)
  # what the parent already has at a version the pins accept stays the parent's
  "${pipv[@]}" install --no-index --find-links "$dir/wheels" -r "$dir/wheels/requirements.txt"
  "${pipv[@]}" install --no-index --no-deps --force-reinstall "$dir"/wheels/packserve-*.whl
  "$venv/bin/python" -c 'import packserve, fastapi, gguf; print("packserve", packserve.__file__)'
}

# llama-server behind a wrapper that sets its libraries for it alone: torch's NVIDIA wheels
# (libcudart, libcublas .so.13), the toolkit's lib64, and the shipped C++ runtime only where the
# machine's is missing or older (ldd's "not found"); torch never sees the shipped libstdc++
install_llama_server() {
  mkdir -p "$dir/bin" "$dir/llama"
  if [ -x "$dir/llama-build/llama-server" ]; then  # built here, a step ago
    cp "$dir/llama-build/llama-server" "$dir/llama/llama-server"
  else
    "$py" "$dir/gpu/box.py" unxz "$dir/llama-server.xz" "$dir/llama/llama-server"
  fi
  chmod +x "$dir/llama/llama-server"
  local libs
  libs=$("$venv/bin/python" "$dir/gpu/box.py" cuda-libs)
  libs+=":${PACKSERVE_CUDA_HOME:-/usr/local/cuda}/lib64"
  libs=${libs#:}
  if LD_LIBRARY_PATH=$libs ldd "$dir/llama/llama-server" 2>&1 | grep -q 'not found' \
      && [ -f "$dir/lib.tar.xz" ]; then
    echo "the machine's C++ runtime is missing or older than the build's: the shipped one"
    mkdir -p "$dir/lib"
    "$py" "$dir/gpu/box.py" untar "$dir/lib.tar.xz" "$dir/lib"
    libs+=":$dir/lib"
  fi
  echo "llama-server's LD_LIBRARY_PATH=$libs"
  if LD_LIBRARY_PATH=$libs ldd "$dir/llama/llama-server" 2>&1 | grep 'not found'; then
    echo "llama-server misses the libraries above (torch's nvidia-cublas / cuda-runtime wheels?)"
    return 1
  fi
  printf '#!/bin/sh\n# written by gpu-check.sh --prepared: the libraries for llama-server alone\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
    "'$libs'" "'$dir/llama/llama-server'" >"$dir/bin/llama-server"
  chmod +x "$dir/bin/llama-server"
  "$dir/bin/llama-server" --list-devices
}

# --- building llama-server on the card, from a folder --prepare --no-compile made ---------------
# First what the build needs there (seconds): nvcc and a host g++ it accepts (a kernel built and
# run on the card), CMake and ninja, cuBLAS's headers and an unversioned libcuda.so for the link;
# where the toolkit lacks the last two, torch's nvidia-cublas wheel and the driver's libcuda.so.1
# stand in, through CPATH and CMAKE_LIBRARY_PATH (an overlay, as --prepare's own).
cuda_home=${PACKSERVE_CUDA_HOME:-/usr/local/cuda}
build_probe() {
  local b=$dir/llama-build overlay=$dir/llama-build/overlay nvcc h l d
  nvcc=$(command -v nvcc || echo "$cuda_home/bin/nvcc")
  "$nvcc" --version | tail -2
  cmake --version | head -1
  echo "ninja $(ninja --version)"
  g++ --version | head -1
  echo "cores: $(nproc)"
  printf '__global__ void k() {}\nint main() { k<<<1, 1>>>(); return cudaDeviceSynchronize(); }\n' >"$b/probe.cu"
  "$nvcc" -arch="sm_${PACKSERVE_CUDA_ARCH:-90}" -o "$b/probe" "$b/probe.cu"
  "$b/probe"
  echo "a kernel built by nvcc with $(g++ -dumpfullversion) ran on the card"
  mkdir -p "$overlay/include" "$overlay/lib"
  if [ ! -f "$cuda_home/include/cublas_v2.h" ]; then
    h=$("$py" "$dir/gpu/box.py" find cublas_v2.h) || { echo "no cublas_v2.h anywhere"; return 1; }
    ln -sf "$(dirname "$h")"/*.h "$overlay/include/"
    echo "cuBLAS headers: $(dirname "$h")"
  fi
  if [ ! -e "$cuda_home/lib64/libcublas.so" ]; then
    for l in libcublas libcublasLt; do
      d=$("$py" "$dir/gpu/box.py" find "$l.so.13") || { echo "no $l.so.13 anywhere"; return 1; }
      ln -sf "$d" "$overlay/lib/$l.so"
    done
  fi
  if [ ! -e "$cuda_home/lib64/stubs/libcuda.so" ] && [ ! -e "$cuda_home/lib64/libcuda.so" ]; then
    d=$(ldconfig -p | sed -n 's/.*libcuda\.so\.1 .*=> //p' | head -1)
    [ -n "$d" ] || { echo "no libcuda.so.1 (the driver's) for the link"; return 1; }
    ln -sf "$d" "$overlay/lib/libcuda.so"
  fi
  ls -l "$overlay/lib"
}

build_here() {
  local seconds=$1 b=$dir/llama-build overlay=$dir/llama-build/overlay nvcc t0=$SECONDS
  nvcc=$(command -v nvcc || echo "$cuda_home/bin/nvcc")
  export CPATH="$overlay/include${CPATH:+:$CPATH}"
  export CMAKE_LIBRARY_PATH="$overlay/lib${CMAKE_LIBRARY_PATH:+:$CMAKE_LIBRARY_PATH}"
  export LIBRARY_PATH="$overlay/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  rm -rf "$b/src" "$b/build" && mkdir -p "$b/src"
  "$py" "$dir/gpu/box.py" untar "$dir/llama.cpp.tar.xz" "$b/src"
  # shellcheck disable=SC2046  # the flags are words
  cmake -S "$b/src" -B "$b/build" $(cat "$b/cmake-flags") -DCMAKE_CUDA_COMPILER="$nvcc"
  echo "configured in $((SECONDS - t0)) s; building, at most $((seconds - (SECONDS - t0))) s"
  timeout -k 10 $((seconds - (SECONDS - t0))) \
    cmake --build "$b/build" --target llama-server -j "$(nproc)"
  echo "built in $((SECONDS - t0)) s"
  strip -o "$b/llama-server" "$b/build/bin/llama-server" || cp "$b/build/bin/llama-server" "$b/llama-server"
}

# the binary back through $OUT, xz-compressed in parts under 16 MiB: a second call carries them
# (cat llama-server.xz.part* > DIR/llama-server.xz) instead of building again
ship_binary() {
  local b=$dir/llama-build
  if command -v xz >/dev/null; then
    # -9 in 16 MiB blocks, so that the ~72 MB binary is compressed on several cores (as one
    # block -9 would use one): a second call carries it beside the wheels and the tree
    xz -9 -T0 --block-size=16MiB -c "$b/llama-server" >"$dir/llama-server.xz"
  else
    "$py" "$dir/gpu/box.py" xz "$b/llama-server" "$dir/llama-server.xz"
  fi
  split -b 15M -d -a 1 "$dir/llama-server.xz" "$report/llama-server.xz.part"
  ls -l "$report"/llama-server.xz.part*
  sha256sum "$b/llama-server" "$dir/llama-server.xz"
}

prepared() {
  { [ -f "$dir/llama-server.xz" ] || [ -f "$dir/llama.cpp.tar.xz" ]; } && [ -d "$dir/wheels" ] \
    || fail "$dir is not a prepared folder"
  dir=$(cd "$dir" && pwd)
  # the budget: everything, report included, inside one device command (600 s at most)
  t_start=$SECONDS
  local total=${PACKSERVE_GPU_CHECK_SECONDS:-570}
  py=${PYTHON:-python3}
  venv=$dir/venv
  logs=$dir/logs
  report=${OUT:-$dir/report}
  rm -rf "$logs" && mkdir -p "$logs" "$report"
  trap finish EXIT
  trap 'say "stopped by a signal"; exit 143' TERM INT
  driver_answers || { echo "nvidia-smi FAILED 0" >"$logs/env-steps.txt"
    fail "no NVIDIA driver answers (nvidia-smi): run this on the GPU machine"; }
  say "python: $("$py" -c 'import sys; print(sys.version.split()[0], sys.prefix)'), $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
    PYTHONUNBUFFERED=1
  env_step venv make_venv
  env_step wheels install_wheels
  if [ ! -f "$dir/llama-server.xz" ]; then
    # the check keeps its minimum (PACKSERVE_GPU_CHECK_MIN_SECONDS: the environment, the
    # rank-0 and rank-1 steps, the cleanup); the build gets the rest, and the check what the
    # build left
    local build_s=$((total - (SECONDS - t_start) - ${PACKSERVE_GPU_CHECK_MIN_SECONDS:-200}))
    [ "$build_s" -ge 120 ] || fail "only $build_s s for the build (PACKSERVE_GPU_CHECK_SECONDS=$total)"
    env_step build-probe build_probe
    env_step build build_here "$build_s"
    env_step ship-binary ship_binary
  fi
  env_step llama-server install_llama_server
  mkdir -p "$dir/src"
  env_step source "$py" "$dir/gpu/box.py" untar "$dir/src.tar.xz" "$dir/src"
  export PACKSERVE_LLAMA_SERVER=$dir/bin/llama-server
  # check.py's deadline is what is left less 20 s for its own cleanup and the logs' packing;
  # timeout sends SIGTERM 10 s past it (check.py stops its servers and writes its report) and
  # SIGKILL 10 s after that
  local left=$((total - (SECONDS - t_start) - 20)) rc=0
  if [ "$left" -lt 30 ]; then
    echo "check-time FAILED 0" >>"$logs/env-steps.txt"
    fail "only $left s left for the check (PACKSERVE_GPU_CHECK_SECONDS=$total)"
  fi
  say "check.py: $left s (its log: $logs/check.log)"
  # shellcheck disable=SC2086  # PACKSERVE_GPU_CHECK_ARGS: extra words for check.py
  timeout -k 10 $((left + 10)) "$venv/bin/python" "$dir/gpu/check.py" --out "$dir/work" \
    --report "$report" --logs "$logs" --deadline "$left" \
    --llama-server "$dir/bin/llama-server" --packserve "$venv/bin/packserve" \
    --tests "$dir/src" --device cuda:0 ${PACKSERVE_GPU_CHECK_ARGS:-} >"$logs/check.log" 2>&1 &
  check_pid=$!
  wait "$check_pid" || rc=$?
  check_pid=
  tail -n 60 "$logs/check.log" >&2
  return "$rc"
}

# After README's serve command alone (scripts/setup.sh without --dev) .venv has no pytest and no
# sentence-transformers: the dry run names the steps it skips for want of them, not a failure.
dry_run() {
  cd "$(dirname "$0")/.."
  local py=${PACKSERVE_GPU_CHECK_PYTHON:-.venv/bin/python} failed=() skipped=()
  [ -x "$py" ] || fail "no .venv here: scripts/setup.sh first"
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
  has() { "$py" -c "import $1" >/dev/null 2>&1; }
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/packserve-gpu-dry.XXXXXX")  # global: the trap reads it
  trap 'rm -rf "$tmp"' EXIT
  # 1. the fake-CUDA tests
  if [ ! -f tests/core/test_fake_cuda.py ]; then
    say "fake-CUDA tests: skipped, tests/core/test_fake_cuda.py is not in this checkout yet"
  elif ! has pytest; then
    skipped+=("fake-CUDA tests (no pytest)")
  else
    say "fake-CUDA tests (tests/core/test_fake_cuda.py)"
    "$py" -m pytest -q -p no:cacheprovider tests/core/test_fake_cuda.py >&2 || failed+=(fake-cuda-tests)
  fi
  # 2. the tiny models, and that they load on the CPU
  local only=() load=(--gguf "$tmp/tiny-llama.gguf")
  if has sentence_transformers; then
    load+=(--bert "$tmp/tiny-bert")
  else
    only=(--only gguf)
    skipped+=("the BERT (no sentence-transformers)")
  fi
  say "tiny models into $tmp"
  if "$py" scripts/gpu/tiny_models.py "$tmp" "${only[@]}" >/dev/null 2>"$tmp/models.log"; then
    "$py" scripts/gpu/load_check.py "${load[@]}" \
      --llama-server "${PACKSERVE_LLAMA_SERVER:-.venv/bin/llama-server}" >&2 || failed+=(tiny-models-load)
  else
    cat "$tmp/models.log" >&2
    failed+=(tiny-models)
  fi
  # 3. the prepared folder's size
  if [ -n "$dir" ]; then
    if { [ -f "$dir/llama-server.xz" ] || [ -f "$dir/llama.cpp.tar.xz" ]; } && [ -d "$dir/wheels" ] \
        && [ -f "$dir/gpu/check.py" ]; then
      check_size "$dir" || failed+=(size)
    else
      say "$dir is not a prepared folder (scripts/gpu-check.sh --prepare $dir)"
      failed+=(prepared-folder)
    fi
  fi
  [ ${#skipped[@]} -eq 0 ] \
    || say "skipped for want of the dev install (scripts/setup.sh --dev): $(IFS=';'; echo "${skipped[*]}" | sed 's/;/; /g')"
  [ ${#failed[@]} -eq 0 ] || fail "dry run: failed: ${failed[*]}"
  if driver_answers; then
    say "dry run passed; an NVIDIA driver answers here: run --prepared DIR for the check on the card"
    return 0
  fi
  say "dry run passed; no NVIDIA driver was found (nvidia-smi), so the steps on the card did not run"
  return 1
}

case "$mode" in
  --prepare) prepare ;;
  --prepared) prepared ;;
  --dry-run) dry_run ;;
esac
