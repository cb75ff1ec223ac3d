#!/usr/bin/env bash
# scripts/device_check through its configure stage, in a fresh build folder: the script runs
# once per lent GPU machine, so a mistake in it would otherwise first show there. Also what
# it leaves in $OUT: a lent machine returns at most 8 files, so the script keeps its summary
# and one archive of the logs there, not a file per stage.
#   OUT, DECENT_DP_DEVICE_BUILD_DIR, DECENT_DP_PYTHON: as scripts/device_check takes them.
set -euo pipefail
: "${OUT:?set OUT}" "${DECENT_DP_DEVICE_BUILD_DIR:?set DECENT_DP_DEVICE_BUILD_DIR}"
rm -rf "$DECENT_DP_DEVICE_BUILD_DIR" "$OUT"
bash "$(dirname "$0")/../../scripts/device_check" --configure-only
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
left=$(cd "$OUT" && ls | grep -vx 'gpus.txt' | tr '\n' ' ')
[ "$left" = "logs.tar.gz summary.json " ] || fail "\$OUT holds '$left', expected logs.tar.gz and summary.json"
tar -tzf "$OUT/logs.tar.gz" | grep -qx './configure.log' || fail "logs.tar.gz has no configure.log"
grep -q '"configure": "passed"' "$OUT/summary.json" || fail "summary.json: $(cat "$OUT/summary.json")"
echo "device_check --configure-only: passed; \$OUT holds $left"
