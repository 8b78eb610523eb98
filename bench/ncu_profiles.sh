#!/bin/sh
# Nsight Compute profiles behind the closing notes of the speed issue (run on the GPU machine):
#   sh bench/ncu_profiles.sh OUTDIR
# heat 4K in block scope, heat 64K in grid scope with and without the per-step poll, and the
# hand-written CUDA C++ cooperative kernel at 64K.
out=${1:-.}
sections="--section SpeedOfLight --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy --section SchedulerStats"
prof() { name=$1; shift; ncu --clock-control none -k regex:"$KREGEX" --launch-skip ${SKIP:-1} --launch-count 1 $sections "$@" > "$out/ncu-$name.txt" 2>&1; }
KREGEX=_lk_kernel prof heat4k-block python3 bench/ncu_heat.py 4096 2000 block
KREGEX=_lk_kernel prof heat64k-grid python3 bench/ncu_heat.py 65536 2000 grid
KREGEX=_lk_kernel prof heat64k-grid-nopoll python3 bench/ncu_heat.py 65536 2000 grid nopoll
nvcc -O3 -arch=sm_90 -o /tmp/heat_coop bench/heat_coop.cu && KREGEX=heat SKIP=1 prof heat64k-cpp /tmp/heat_coop 65536 2000 1
