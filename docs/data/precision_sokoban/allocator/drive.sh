#!/bin/bash
# alternate allocators, ROUNDS rounds; each line: round variant times
cd /work/main && . .venv/bin/activate
RUN=/work/runs/whole/results/smollm2-sokoban
for r in $(seq 1 $1); do
  for v in ${VARIANTS:-glibc jemalloc tcmalloc glibc_tuned}; do
    case $v in
      glibc) env=() ;;
      jemalloc) env=(LD_PRELOAD=/lib/x86_64-linux-gnu/libjemalloc.so.2) ;;
      tcmalloc) env=(LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4) ;;
      glibc_tuned) env=(MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=268435456) ;;
    esac
    echo "$r $v $(env "${env[@]}" python /work/runs/alloc/exp_allocator.py 3 $RUN 2>/dev/null | tail -1)"
  done
done
