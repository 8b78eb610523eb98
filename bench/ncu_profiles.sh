#!/bin/sh
# Nsight Compute profiles behind the closing notes of the speed issue (run on the GPU machine):
#   sh bench/ncu_profiles.sh OUTDIR [SET]
# SET 2026-12-02 (the default): heat 4K in block scope, heat 64K in grid scope with and without
# the per-step poll, and the hand-written CUDA C++ cooperative kernel at 64K.
# SET 1m: heat 1M in the grid scope (loopkern's own 32-bit element accesses) and in tile mode
# (rounds of steps on chip), the C++ kernel at 1M; 2-D heat 1024x1024 in the grid scope, in
# tile mode, and the 2-D C++ kernel. Each kernel runs 2000 steps in its profiled launch.
# SET misses: Life 1024x1024 and Jacobi 256x256 in the grid scope, 2000 steps each.
out=${1:-.}
set=${2:-2026-12-02}
sections="--section SpeedOfLight --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy --section SchedulerStats"
prof() { name=$1; shift; ncu --clock-control none -k regex:"$KREGEX" --launch-skip ${SKIP:-1} --launch-count 1 $sections "$@" > "$out/ncu-$name.txt" 2>&1; }
if [ "$set" = misses ]; then
  # the issue-12 rows that miss their targets and had no profile: Life 1024x1024 and Jacobi
  # 256x256 (a reduction every step) in the grid scope that scope="auto" picks
  KREGEX=_lk_kernel prof life1024-grid python3 bench/ncu_heat.py life1024 2000 grid
  KREGEX=_lk_kernel prof jacobi256-grid python3 bench/ncu_heat.py jacobi256 2000 grid
  exit 0
fi
if [ "$set" = 1m ]; then
  KREGEX=_lk_kernel prof heat1m-grid python3 bench/ncu_heat.py 1048576 2000 grid
  KREGEX=_lk_kernel prof heat1m-tile python3 bench/ncu_heat.py 1048576 2000 tile
  nvcc -O3 -arch=sm_90 -o /tmp/heat_coop bench/heat_coop.cu && KREGEX=heat SKIP=1 prof heat1m-cpp /tmp/heat_coop 1048576 2000 1
  KREGEX=_lk_kernel prof heat2d1024-grid python3 bench/ncu_heat.py 1024x1024 2000 grid
  KREGEX=_lk_kernel prof heat2d1024-tile python3 bench/ncu_heat.py 1024x1024 2000 tile
  nvcc -O3 -arch=sm_90 -o /tmp/heat2d_coop bench/heat2d_coop.cu && KREGEX=heat2d SKIP=1 prof heat2d1024-cpp /tmp/heat2d_coop 1024 2000 1
  exit 0
fi
KREGEX=_lk_kernel prof heat4k-block python3 bench/ncu_heat.py 4096 2000 block
KREGEX=_lk_kernel prof heat64k-grid python3 bench/ncu_heat.py 65536 2000 grid
KREGEX=_lk_kernel prof heat64k-grid-nopoll python3 bench/ncu_heat.py 65536 2000 grid nopoll
nvcc -O3 -arch=sm_90 -o /tmp/heat_coop bench/heat_coop.cu && KREGEX=heat SKIP=1 prof heat64k-cpp /tmp/heat_coop 65536 2000 1
