#!/bin/bash
# stages through the product's path: runtime.allocator auto (tcmalloc) against system, alternating
cd /work/main && . .venv/bin/activate
RUN=/work/runs/whole/results/smollm2-sokoban
for r in $(seq 1 $1); do
  for v in ${VARIANTS:-system auto}; do
    out=/work/runs/alloc/product_${v}_$r
    python -m bench.precision --params configs/smollm2-sokoban.yaml --run $RUN --jobs $JOBS \
      --dtypes bfloat16 --repeats 1 --set runtime.allocator=$v --scratch /work/runs/alloc/pscratch_$v --out $out >$out.log 2>&1
    echo "$r $v $(tail -n +2 $out/precision_jobs.csv | cut -d, -f1,5 | tr '\n' ' ')"
  done
done
