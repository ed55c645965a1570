#!/usr/bin/env bash
# Issue 16, the device share of the update on a GPU, in two device calls of about 6 minutes each: correctness and
# where a step's time goes, then the side by side. From the repo root on the device machine, after the wheel install
# line of ../shared/device/bundle-wheels.sh, with ab_threads/ carried: the library before its device updates were
# queued from the main thread (git archive e1dd91f lightning_lazytrain | tar -x -C ab_threads).
#   bash benchmarks/device_share_gpu.sh diagnose "$OUT"  # GPU tests; the kernel alone; one layer's memory,
#                                                       measured and estimated; profiles of the 3B b8 step
#   bash benchmarks/device_share_gpu.sh ab "$OUT"        # CPU-only / worker threads / main thread, 3B b8, 2 runs each
set -uo pipefail
mode=${1:?diagnose or ab}
out=${2:?output dir}
mkdir -p "$out/results"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
case $mode in
  diagnose)
    python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_fused_update.py tests/test_gpu_parity.py \
      > "$out/gpu_tests.txt" 2>&1
    tail -n 3 "$out/gpu_tests.txt"
    python benchmarks/update_kernel_gpu.py --out "$out/results/update_kernel.json"
    python benchmarks/layer_memory_gpu.py --out "$out/results/layer_memory.json"
    python benchmarks/profile_step_gpu.py --system lazytrain-gpu-updates-plan --out "$out/profile_plan"
    PYTHONPATH="$PWD/ab_threads:$PYTHONPATH" python benchmarks/profile_step_gpu.py \
      --system lazytrain-gpu-updates-plan --out "$out/profile_threads"
    python benchmarks/profile_step_gpu.py --system lazytrain --out "$out/profile_cpu"
    ;;
  ab)
    python benchmarks/ab_gpu.py --side cpu=. --side threads=ab_threads:lazytrain-gpu-updates-plan \
      --side plan=.:lazytrain-gpu-updates-plan --cases 3b-b8 --runs 2 --out "$out/results/ab_3b_launch.json"
    ;;
  *)
    echo "mode must be diagnose or ab" >&2
    exit 2
    ;;
esac
