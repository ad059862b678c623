#!/usr/bin/env bash
# Health probe for a batch trainer started by entrypoint.sh (Kubernetes exec probes, Docker HEALTHCHECK).
#
#   probe.sh started   success once torchrun runs (the pid entrypoint.sh recorded is alive and is torchrun),
#                      or once the run is complete (the completion marker exists: the pod idles).
#   probe.sh alive     the same, and, when DT_LOG_DIR is set and DT_STALL_SECONDS > 0, something moved
#                      in the last DT_STALL_SECONDS: a file under DT_LOG_DIR (the trainer's JSONL and
#                      TensorBoard logs, flushed every logging.every steps) or the launch itself. A job
#                      stuck in a collective that never times out is restarted; the idle pod never is.
#
# Reads DT_CHECKPOINT_DIR, DT_COMPLETION_MARKER and DT_STATE_DIR with entrypoint.sh's defaults.
# Uses only bash and coreutils/findutils, no procps. Prints why it fails.
set -euo pipefail

mode=${1:-alive}
marker=${DT_COMPLETION_MARKER:-${DT_CHECKPOINT_DIR:-/checkpoints}/COMPLETED}
pidfile=${DT_STATE_DIR:-/tmp/dtrain}/trainer.pid

case $mode in
    started | alive) ;;
    *) echo "usage: $0 started|alive" >&2; exit 2 ;;
esac

if [ -e "$marker" ]; then
    exit 0
fi

if [ ! -s "$pidfile" ]; then
    echo "trainer not launched yet: no $pidfile"
    exit 1
fi
read -r pid < "$pidfile"
if ! [[ $pid =~ ^[0-9]+$ ]] || [ ! -r "/proc/$pid/cmdline" ]; then
    echo "trainer (pid $pid) is not running"
    exit 1
fi
mapfile -d '' -t argv < "/proc/$pid/cmdline" || true
is_torchrun=0
for arg in "${argv[@]}"; do
    if [ "$arg" = torch.distributed.run ] || [ "${arg##*/}" = torchrun ]; then is_torchrun=1; fi
done
if [ "$is_torchrun" != 1 ]; then
    echo "pid $pid is not torchrun: ${argv[*]:-?}"
    exit 1
fi

stall=${DT_STALL_SECONDS:-0}
if [ "$mode" = alive ] && [ -n "${DT_LOG_DIR:-}" ] && [ "$stall" -gt 0 ]; then
    since=$(( $(date +%s) - stall ))
    recent=$(find "$pidfile" "$DT_LOG_DIR" -type f -newermt "@$since" -print -quit 2>/dev/null || true)
    if [ -z "$recent" ]; then
        echo "no progress: nothing under $DT_LOG_DIR changed, and torchrun was not launched, in the last ${stall}s"
        exit 1
    fi
fi
exit 0
