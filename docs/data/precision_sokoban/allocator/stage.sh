#!/bin/bash
# the update stage of iteration 1 (bf16), allocators alternating, ROUNDS rounds
cd /work/main && . .venv/bin/activate
RUN=/work/runs/whole/results/smollm2-sokoban
for r in $(seq 1 $1); do
  for v in ${VARIANTS:-glibc thr32 tcmalloc}; do
    case $v in
      glibc) env=() ;;
      thr32) env=(MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=68719476736) ;;
      tcmalloc) env=(LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4) ;;
      nommap) env=(MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=268435456) ;;
    esac
    env "${env[@]}" python -m bench.precision --params configs/smollm2-sokoban.yaml --run $RUN --jobs update@1 \
      --dtypes bfloat16 --repeats 1 --scratch /work/runs/alloc/scratch_$v --out /work/runs/alloc/stage_${v}_$r >/work/runs/alloc/stage_${v}_$r.log 2>&1
    echo "$r $v $(tail -n +2 /work/runs/alloc/stage_${v}_$r/precision_jobs.csv | head -3)"
  done
done
