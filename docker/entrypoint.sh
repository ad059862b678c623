#!/usr/bin/env bash
# Container entrypoint: run this node's share of one `distributed_training` job under torchrun, or idle
# if the job has already finished.
#
# Every setting comes from the environment. Ours (DT_*) win; torchrun's own PET_* variables are used
# next, and torchrun itself reads any PET_* this script does not pass as a flag (PET_RDZV_CONF,
# PET_LOCAL_ADDR, PET_MONITOR_INTERVAL, ...).
#
#   DT_CONFIG             the job's YAML                        (default /config/config.yaml)
#   DT_EXTRA_ARGS         more CLI arguments, shell-quoted, e.g. "--set training.max_steps=10";
#                         arguments given to the container itself are appended after them
#   DT_NNODES             number of nodes (pods), or MIN:MAX    (PET_NNODES, else 1). MIN:MAX is elastic:
#                         the job runs with any number of nodes from MIN to MAX, re-forming (every worker
#                         restarts from the latest checkpoint) when a node leaves or joins; see
#                         docs/elastic.md. Elastic runs default TORCH_DISABLE_SHARE_RDZV_TCP_STORE to 1
#                         (growth needs it) and want short rendezvous timeouts in PET_RDZV_CONF.
#   DT_NPROC_PER_NODE     processes on this node                (PET_NPROC_PER_NODE, else the number of
#                                                                GPUs `nvidia-smi -L` lists, else 1)
#   DT_NODE_RANK          this node's rank                      (PET_NODE_RANK, else the StatefulSet
#                         ordinal ending $HOSTNAME, "dtrain-1" -> 1, else 0). The c10d rendezvous ignores
#                         it and orders nodes by host name (then pid): in the StatefulSet, pod dtrain-0
#                         gets global ranks 0..nproc-1; here it only labels this node in the logs.
#   DT_MASTER_HOST        host of the rendezvous                (default localhost)
#   DT_RDZV_ENDPOINT      HOST:PORT of the rendezvous           (PET_RDZV_ENDPOINT, else $DT_MASTER_HOST:29400)
#   DT_RDZV_BACKEND       rendezvous backend                    (PET_RDZV_BACKEND, else c10d)
#   DT_JOB_ID             rendezvous id, the same on all nodes  (PET_RDZV_ID, else dtrain)
#   DT_MAX_RESTARTS       worker-group restarts torchrun allows (PET_MAX_RESTARTS, else 3)
#   DT_CHECKPOINT_DIR     this node's checkpoint volume         (default /checkpoints)
#   DT_COMPLETION_MARKER  a file that means "this job is done"  (default $DT_CHECKPOINT_DIR/COMPLETED)
#   DT_IDLE_CMD           what to run instead of training once the marker exists (default: sleep until
#                         SIGTERM)
#   DT_PYTHON             the Python that runs torchrun         (default python)
#   DT_STATE_DIR          where the trainer's pid file goes, read by probe.sh  (default /tmp/dtrain)
#
# Completed runs: a StatefulSet restarts a pod whose container exits, even with status 0, so a finished
# job would train again, forever. Rank 0 of the job writes COMPLETED into checkpoint.dir; in addition,
# when torchrun exits 0 on this node, this script writes $DT_COMPLETION_MARKER itself, so that every
# node, each with its own volume, knows the job is done. While the marker exists the script only idles.
# Delete the marker(s) to train again.
#
# torchrun is run as a child rather than exec'ed (the marker must be written after it exits); SIGTERM
# and SIGINT are passed on to it, and the script exits with torchrun's status. A node that was sent a
# signal never writes the marker, whatever torchrun's status: it was stopped (a scale-down removes it,
# or the pod is deleted), which says nothing about the job being done.
set -euo pipefail

log() { printf '[dtrain-entrypoint] %s\n' "$*" >&2; }

DT_PYTHON=${DT_PYTHON:-python}
DT_CONFIG=${DT_CONFIG:-/config/config.yaml}
DT_CHECKPOINT_DIR=${DT_CHECKPOINT_DIR:-/checkpoints}
DT_COMPLETION_MARKER=${DT_COMPLETION_MARKER:-$DT_CHECKPOINT_DIR/COMPLETED}
DT_STATE_DIR=${DT_STATE_DIR:-/tmp/dtrain}
DT_EXTRA_ARGS=${DT_EXTRA_ARGS:-}

idle() {
    if [ -n "${DT_IDLE_CMD:-}" ]; then
        log "$1; idling: $DT_IDLE_CMD"
        exec bash -c "$DT_IDLE_CMD"
    fi
    # A plain `sleep infinity` as PID 1 ignores SIGTERM (no handler), which would stall pod deletion
    # for the whole grace period; sleep in the background and leave on the first signal instead.
    local sleeper=""
    trap 'kill "$sleeper" 2>/dev/null || true; exit 0' TERM INT
    log "$1; idling until stopped"
    while :; do
        sleep 3600 &
        sleeper=$!
        wait "$sleeper" || true
    done
}

if [ -e "$DT_COMPLETION_MARKER" ]; then
    idle "run complete: $DT_COMPLETION_MARKER exists, so this node will not train again (delete it to rerun)"
fi

gpu_count() {
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    fi
    if [ "${n:-0}" -gt 0 ] 2>/dev/null; then echo "$n"; else echo 1; fi
}

pod_ordinal() {
    # StatefulSet pods are named <statefulset>-<ordinal>.
    local host=${HOSTNAME:-$(hostname 2>/dev/null || true)}
    local ordinal=${host##*-}
    if [ "$ordinal" != "$host" ] && [[ $ordinal =~ ^[0-9]+$ ]]; then echo "$ordinal"; else echo 0; fi
}

nnodes=${DT_NNODES:-${PET_NNODES:-1}}
nproc=${DT_NPROC_PER_NODE:-${PET_NPROC_PER_NODE:-$(gpu_count)}}
node_rank=${DT_NODE_RANK:-${PET_NODE_RANK:-$(pod_ordinal)}}
rdzv_endpoint=${DT_RDZV_ENDPOINT:-${PET_RDZV_ENDPOINT:-${DT_MASTER_HOST:-localhost}:29400}}
rdzv_backend=${DT_RDZV_BACKEND:-${PET_RDZV_BACKEND:-c10d}}
rdzv_id=${DT_JOB_ID:-${PET_RDZV_ID:-dtrain}}
max_restarts=${DT_MAX_RESTARTS:-${PET_MAX_RESTARTS:-3}}

if [[ $nnodes == *:* ]]; then
    # torch's shared rendezvous store keeps a node that stays the rendezvous' rank 0 from publishing the
    # new round's master address, so a joining node waits for it until its store times out.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
fi

if [ ! -r "$DT_CONFIG" ]; then
    log "config file $DT_CONFIG does not exist or is not readable (set DT_CONFIG, or mount the ConfigMap at /config)"
    exit 2
fi

mkdir -p "$DT_STATE_DIR"
extra=()
if [ -n "$DT_EXTRA_ARGS" ]; then
    # Split like a shell would (quotes respected), without evaluating anything.
    if ! "$DT_PYTHON" -c 'import shlex, sys
sys.stdout.write("".join(a + "\0" for a in shlex.split(sys.argv[1])))' "$DT_EXTRA_ARGS" > "$DT_STATE_DIR/extra_args"; then
        log "DT_EXTRA_ARGS is not valid shell quoting: $DT_EXTRA_ARGS"
        exit 2
    fi
    mapfile -d '' -t extra < "$DT_STATE_DIR/extra_args"
fi

cmd=("$DT_PYTHON" -m torch.distributed.run
    "--nnodes=$nnodes"
    "--nproc-per-node=$nproc"
    "--node-rank=$node_rank"
    "--rdzv-backend=$rdzv_backend"
    "--rdzv-endpoint=$rdzv_endpoint"
    "--rdzv-id=$rdzv_id"
    "--max-restarts=$max_restarts"
    -m distributed_training "$DT_CONFIG" "${extra[@]}" "$@")

log "node $node_rank of $nnodes, $nproc process(es), rendezvous $rdzv_backend at $rdzv_endpoint (id $rdzv_id)${PET_RDZV_CONF:+ conf $PET_RDZV_CONF}"
log "running: ${cmd[*]}"

signals=0
child=""
trap 'signals=$((signals + 1)); [ -z "$child" ] || kill -TERM "$child" 2>/dev/null || true' TERM INT
"${cmd[@]}" &
child=$!
[ "$signals" -eq 0 ] || kill -TERM "$child" 2>/dev/null || true  # stopped while launching
# The pid file tells probe.sh which process is the trainer; its mtime is the launch time.
printf '%s\n' "$child" > "$DT_STATE_DIR/trainer.pid.tmp"
mv -f "$DT_STATE_DIR/trainer.pid.tmp" "$DT_STATE_DIR/trainer.pid"

while :; do
    seen=$signals
    rc=0
    wait "$child" || rc=$?
    # `wait` also returns when a trapped signal arrives; then wait again for torchrun's own status.
    [ "$signals" = "$seen" ] && break
done
trap - TERM INT
rm -f "$DT_STATE_DIR/trainer.pid"

if [ "$rc" -ne 0 ]; then
    log "torchrun exited with status $rc"
    exit "$rc"
fi
if [ "$signals" -ne 0 ]; then
    log "torchrun exited with status 0 after this node was told to stop; not marking the run complete"
    exit 0
fi
mkdir -p "$(dirname "$DT_COMPLETION_MARKER")"
[ -e "$DT_COMPLETION_MARKER" ] || : > "$DT_COMPLETION_MARKER"
log "training finished; marked complete at $DT_COMPLETION_MARKER (this node will idle when restarted)"
