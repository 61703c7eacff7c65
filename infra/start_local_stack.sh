#!/usr/bin/env bash
# Deployments end to end on one machine: SeaweedFS (S3), a Prefect server, a process
# work pool with a worker, a GPU concurrency limit, and infra/prefect.yaml's deployments
# pointed at that pool. Ctrl-C stops everything this script started.
#
#   infra/start_local_stack.sh [STATE_DIR]
#   # another shell:
#   export PREFECT_API_URL=http://127.0.0.1:4200/api
#   prefect deployment run batch-inference/nightly --param job='{"input": "s3://demo/prompts", ...}'
#   open http://127.0.0.1:4200 for the UI forms, schedules and runs
#
# Environment: PREFECT_PORT (4200), S3_PORT (8333), WORK_POOL (shardline-local),
# GPU_LIMIT (shardline-gpus) and GPU_SLOTS (1); AWS_* as in start_object_store.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STATE_DIR="${1:-${TMPDIR:-/tmp}/shardline-local-stack}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
S3_PORT="${S3_PORT:-8333}"
WORK_POOL="${WORK_POOL:-shardline-local}"
GPU_LIMIT="${GPU_LIMIT:-shardline-gpus}"
GPU_SLOTS="${GPU_SLOTS:-1}"
mkdir -p "$STATE_DIR"

# The worker's flow runs reach the object store with the standard AWS variables.
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-shardline}"
export AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-shardline-secret}"
export AWS_ENDPOINT_URL="${AWS_ENDPOINT_URL:-http://127.0.0.1:$S3_PORT}"
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
export PREFECT_HOME="$STATE_DIR/prefect"
export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false

PIDS=()
stop_all() {  # TERM, then KILL what is left after 10 s (weed can hang on shutdown)
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 10); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 1
  done
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT INT TERM

wait_for() {  # wait_for WHAT COMMAND...
  local what="$1"; shift
  for _ in $(seq 1 120); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "$what did not come up; logs in $STATE_DIR" >&2
  exit 1
}

"$ROOT/infra/start_object_store.sh" "$STATE_DIR/object-store" "$S3_PORT" >"$STATE_DIR/object-store.log" 2>&1 &
PIDS+=($!)
prefect server start --host 127.0.0.1 --port "$PREFECT_PORT" >"$STATE_DIR/prefect-server.log" 2>&1 &
PIDS+=($!)
wait_for "the Prefect server" python3 -c "import urllib.request; urllib.request.urlopen('$PREFECT_API_URL/health')"
wait_for "SeaweedFS" python3 -c "import urllib.request as u, urllib.error as e
try: u.urlopen('$AWS_ENDPOINT_URL')
except e.HTTPError: pass"

prefect work-pool create "$WORK_POOL" --type process --overwrite >/dev/null
prefect gcl inspect "$GPU_LIMIT" >/dev/null 2>&1 || prefect gcl create "$GPU_LIMIT" --limit "$GPU_SLOTS" >/dev/null
# Same deployments as on Kubernetes, on the local process pool (--pool overrides the
# file's pool only when one deployment is deployed at a time).
for deployment in nightly daily-backfill; do
  (cd "$ROOT" && prefect --no-prompt deploy --prefect-file infra/prefect.yaml --name "$deployment" \
     --pool "$WORK_POOL") >>"$STATE_DIR/deploy.log"
done

echo "Prefect UI http://127.0.0.1:$PREFECT_PORT  S3 $AWS_ENDPOINT_URL  pool $WORK_POOL  state $STATE_DIR"
prefect worker start --pool "$WORK_POOL" --type process >"$STATE_DIR/worker.log" 2>&1 &
PIDS+=($!)
wait "${PIDS[@]}"
