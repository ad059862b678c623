#!/usr/bin/env bash
# Session 28: only the 1-GPU machine (nvidia-h200) was lent. Results go straight to $OUT (no tar).
#   A: ZB-H1 with CUDA graphs (its I and W passes as graphs of their own): the graphs' GPU tests (the
#      one-GPU ones run; those needing 2 or 4 GPUs skip), then on one GPU a stage-sized GPT-1.3B (6
#      blocks with the embedding and the tied head, 8 microbatches of 2 x 1024 tokens, bf16) through our
#      engine at P = 1: 1F1B and ZB-H1, eager and graphed, interleaved over 3 rounds (no pipeline: what
#      the split and the graphs cost or save on the GPU and the host, not the bubble).
#   B: A again after the linear layers' weight casts were cached once a step in the graphs (A: the graphed
#      forwards 8% slower than eager ones, each replay casting every weight again).
. benchmarks/device_env.sh
case "$1" in
  A|B) timeout -k 5 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py \
       > "$OUT/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests.log"
     timeout -k 5 300 torchrun --standalone --nproc_per_node=1 benchmarks/pipeline_profile.py --out "$OUT/stage" \
       --layers 6 --variants ours_1f1b,ours-graphs_1f1b,ours_zbh1,ours-graphs_zbh1 --profile none \
       --rounds 3 --steps 4 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/stage.log"
     echo "stage exit $? at $(( $(date +%s) - start )) s" >> "$OUT/stage.log" ;;
  # C: the graphed stage's step against its busy time (~7 ms apart in B): one step of graphed 1F1B traced
  #    (the summary's gaps); and the loss through torch.compile ("closs") against lm_loss as it is, graphed
  #    1F1B / ZB-H1 / GPipe: what the head's loss costs at P = 1.
  C) timeout -k 5 400 torchrun --standalone --nproc_per_node=1 benchmarks/pipeline_profile.py --out "$OUT/stage" \
       --layers 6 --variants ours-graphs_1f1b,ours-graphs-closs_1f1b,ours-graphs_zbh1,ours-graphs-closs_zbh1,ours-graphs_gpipe,ours-graphs-closs_gpipe \
       --profile ours-graphs_1f1b --rounds 3 --steps 4 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/stage.log"
     echo "stage exit $? at $(( $(date +%s) - start )) s" >> "$OUT/stage.log" ;;
  # D: the compiled loss's GPU test; then GPT-2 124M whole on one GPU (12 blocks of width 768, 8 microbatches
  #    of 2 x 1024 tokens, bf16): a model whose step the host bounds, eager against graphed, 1F1B and ZB-H1,
  #    with the loss as it is and compiled.
  D) timeout -k 5 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_compiled_loss.py \
       > "$OUT/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests.log"
     timeout -k 5 300 torchrun --standalone --nproc_per_node=1 benchmarks/pipeline_profile.py --out "$OUT/gpt2" \
       --model gpt2-124m --variants ours_1f1b,ours-graphs_1f1b,ours_zbh1,ours-graphs_zbh1,ours-graphs-closs_1f1b,ours-graphs-closs_zbh1 \
       --profile none --rounds 3 --steps 4 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/gpt2.log"
     echo "gpt2 exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpt2.log" ;;
  # H1 (2 GPUs, lent late in session 28): the graphs' and compiled loss's GPU tests (the 2-GPU NCCL ones
  #    with ZB-H1 graphed run; the 4-GPU trainer test skips), then the pipeline phase at P = 2, half blocks,
  #    eager / graphed / torch's, every schedule (ZB-H1 graphed too), 2 rounds.
  H1) timeout -k 5 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py \
        tests/test_compiled_loss.py > "$OUT/gpu_tests.log" 2>&1
      echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests.log"
      (cd benchmarks && timeout -k 5 330 python suite.py --out "$OUT/H1" --timeout 320 --worlds 2 --phases pipeline \
         --variants pp,halves,graphs --rounds 2) 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/H1.log"
      echo "H1 exit $? at $(( $(date +%s) - start )) s" >> "$OUT/H1.log" ;;
  # H2 (2 GPUs): the same phase with the loss compiled for ours and torch's (fused_loss), 2 rounds; then the
  #    receive throttle at P = 2 (pipeline_profile: ours graphed with and without it, torch's 1F1B, 3 rounds).
  H2) (cd benchmarks && timeout -k 5 300 python suite.py --out "$OUT/H2" --timeout 290 --worlds 2 --phases pipeline \
         --variants pp,halves,graphs,fused_loss --rounds 2) 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/H2.log"
      echo "H2 exit $? at $(( $(date +%s) - start )) s" >> "$OUT/H2.log"
      timeout -k 5 200 torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_profile.py --out "$OUT/G2" \
        --variants ours-graphs_1f1b,ours-graphs-throttle_1f1b,torch_1f1b --profile none --rounds 3 --steps 4 2>&1 \
        | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/G2.log"
      echo "G2 exit $? at $(( $(date +%s) - start )) s" >> "$OUT/G2.log" ;;
  # H3 (2 GPUs): the user's path, DistributedTrainer (DDP inside the stages, a meta-built GPT-1.3B, cut by
  #    compute at half blocks) at P = 2: ZB-H1 eager / graphed / graphed with the loss compiled, graphed
  #    1F1B, against torch's 1F1B on the engine's stages; 3 rounds.
  H3) timeout -k 5 400 torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_profile.py --out "$OUT/H3" \
        --variants trainer-halves_zbh1,trainer-halves-graphs_zbh1,trainer-halves-graphs-closs_zbh1,trainer-halves-graphs_1f1b,torch-halves_1f1b \
        --profile none --rounds 3 --steps 4 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/H3.log"
      echo "H3 exit $? at $(( $(date +%s) - start )) s" >> "$OUT/H3.log" ;;
  # For a 4-GPU machine (not lent in session 28; run with kind nvidia-h200-x4 when it is):
  # E: the graphs' and the compiled loss's GPU tests (2- and 4-GPU ones included: ZB-H1 graphed over NCCL
  #    and through the trainer at P = 2 x DP = 2), then P = 4 at half blocks with the loss compiled for
  #    ours and torch's (fused_loss; torch's ZB schedule skipped: it hangs on it), eager and graphed, 2
  #    rounds: ZB-H1's graphed bubble, GPipe's bubble with the compiled loss.
  E) timeout -k 5 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py \
       tests/test_compiled_loss.py > "$OUT/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests.log"
     (cd benchmarks && timeout -k 5 340 python suite.py --out "$OUT/E" --timeout 330 --worlds 4 --phases pipeline \
        --variants pp,halves,graphs,fused_loss --rounds 2) 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/E.log"
     echo "E exit $? at $(( $(date +%s) - start )) s" >> "$OUT/E.log" ;;
  # F: the README's table: P = 4 and P = 2 x DP = 2, half blocks, eager and graphed (ZB-H1 too),
  #    the loss as it is, 3 rounds.
  F) (cd benchmarks && timeout -k 5 580 python suite.py --out "$OUT/F" --timeout 570 --worlds 4 --phases pipeline \
        --variants pp,pp_dp,halves,graphs --rounds 3) 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/F.log"
     echo "F exit $? at $(( $(date +%s) - start )) s" >> "$OUT/F.log" ;;
  # G (4 GPUs): is graphed 1F1B held back by receives posted far ahead of the GPU? Ours graphed with and
  #    without the receive throttle against torch's 1F1B at P = 4, 3 rounds, one step of each traced
  #    (summary: the NCCL kernels' overlap with the compute stream).
  G) timeout -k 5 300 torchrun --standalone --nproc_per_node=4 benchmarks/pipeline_profile.py --out "$OUT/G" \
       --variants ours-graphs_1f1b,ours-graphs-throttle_1f1b,torch_1f1b \
       --profile ours-graphs_1f1b,ours-graphs-throttle_1f1b,torch_1f1b --rounds 3 --steps 4 2>&1 \
       | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/G.log"
     echo "G exit $? at $(( $(date +%s) - start )) s" >> "$OUT/G.log" ;;
esac
