#!/usr/bin/env bash
# Session 29: only the 1-GPU machine (nvidia-h200) was lent. Results go straight to $OUT.
#   A: the pipeline graphs' and compiled loss's one-GPU tests (ZB-H1's graphed split backward against the
#      eager one, and StageGraphs.clear() handing the graph pools back: written after session 28's last
#      device minute, never run), then every other GPU test that one GPU can run (the rest skip; the image
#      lacks pydantic, so the files that need it fail to collect and are named in the log).
. benchmarks/device_env.sh
case "$1" in
  A) gpu_tests gpu_tests_graphs 200 tests/test_pipeline_graphs.py tests/test_compiled_loss.py -rs
     gpu_tests gpu_tests_all 330 --continue-on-collection-errors --deselect tests/test_pipeline_graphs.py \
       --deselect tests/test_compiled_loss.py --durations=15 ;;
esac
