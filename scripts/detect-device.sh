#!/usr/bin/env bash
# Which build of packserve's engines fits this machine: sourced by scripts/setup.sh, runnable on
# its own (it prints what it found). Reads only the environment and `nvidia-smi`; installs nothing.
#
#   PACKSERVE_DEVICE=cuda|cpu  force the build (default: cuda when an NVIDIA driver answers)
#   PACKSERVE_CUDA_ARCH=90     the CUDA architecture to compile for (default: the first card's
#                              compute capability from nvidia-smi, 9.0 -> 90)
#
# packserve_detect_device sets
#   device_build   cpu or cuda
#   device_reason  why, in words, for setup to print
#   cuda_arch      the architecture to compile for ("" on cpu, or when nvidia-smi did not say)
# and returns 2 on a PACKSERVE_DEVICE it does not know.
packserve_detect_device() {
  device_build=cpu
  device_reason=""
  cuda_arch=""
  local asked=${PACKSERVE_DEVICE:-} smi="" cap=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    # The first card's compute capability ("9.0"); a driver that does not answer is no driver.
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || cap=""
    cap=${cap%%$'\n'*}
    cap=${cap//[[:space:]]/}
    if [[ $cap =~ ^[0-9]+\.[0-9]+$ ]]; then
      smi="an NVIDIA driver answers (nvidia-smi: compute capability $cap)"
    else
      cap=""
    fi
  fi
  case "$asked" in
    cuda)
      device_build=cuda
      device_reason="PACKSERVE_DEVICE=cuda${smi:+; $smi}" ;;
    cpu)
      device_reason="PACKSERVE_DEVICE=cpu${smi:+, although $smi}" ;;
    "")
      if [ -n "$smi" ]; then
        device_build=cuda
        device_reason=$smi
      elif command -v nvidia-smi >/dev/null 2>&1; then
        device_reason="nvidia-smi is on PATH but reports no GPU (no driver loaded?)"
      else
        device_reason="no NVIDIA driver (no nvidia-smi on PATH)"
      fi ;;
    *)
      device_reason="PACKSERVE_DEVICE=$asked: expected cuda or cpu"
      return 2 ;;
  esac
  if [ "$device_build" = cuda ]; then
    if [ -n "${PACKSERVE_CUDA_ARCH:-}" ]; then
      cuda_arch=$PACKSERVE_CUDA_ARCH
      device_reason+="; CUDA architecture $cuda_arch from PACKSERVE_CUDA_ARCH"
    elif [ -n "$cap" ]; then
      cuda_arch=${cap/./}
      device_reason+="; CUDA architecture $cuda_arch"
    fi
  fi
  return 0
}

# The CUDA compiler: on PATH, else the toolkit's standard prefix; prints its path, or fails.
packserve_find_nvcc() {
  if command -v nvcc >/dev/null 2>&1; then
    command -v nvcc
  elif [ -x "${PACKSERVE_CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    echo "${PACKSERVE_CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  else
    return 1
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  rc=0
  packserve_detect_device || rc=$?
  echo "build: $device_build"
  echo "reason: $device_reason"
  [ -z "$cuda_arch" ] || echo "cuda_arch: $cuda_arch"
  exit "$rc"
fi
