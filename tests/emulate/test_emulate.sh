#!/usr/bin/env bash
# Smoke test of benchmarks/emulate/cluster: 2 emulated nodes of one rank each, one gossip_bench
# size across them; then a failing command; after each, no namespace or interface of the run
# is left. Exits 77 (ctest: skipped) where namespaces cannot be made (not root, no netns).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${DECENT_DP_BUILD_DIR:-$root/build}"
cluster="$root/benchmarks/emulate/cluster"
leftovers() {
  { ip netns list 2>/dev/null; ip -o link show 2>/dev/null; } | grep -c 'ddpe[0-9]' || true
}
before="$(leftovers)"

# Every link of the run (2 nodes x 2 directions) holds at most 20 ms of queue: counted on
# the host side (hN) and the node side (eth0 in node N's namespace) of each node's link.
queue_check="$(mktemp)"
trap 'rm -f "$queue_check"' EXIT
cat >"$queue_check" <<'SH'
links=0
while read -r ns _; do
  i="${ns##*n}"
  tc qdisc show dev "${ns%n*}h$i" | grep -q ' lat 20ms' && links=$((links + 1))
  ip netns exec "$ns" tc qdisc show dev eth0 | grep -q ' lat 20ms' && links=$((links + 1))
done <"$EMU_HOSTFILE"
echo "links with a 20 ms queue: $links"
SH
out="$("$cluster" --nodes 2 --ranks-per-node 1 --rate 1gbit --queue-ms 20 -- \
  sh -c "sh '$queue_check' && \$EMU_MPIRUN -n 2 '$build/bin/gossip_bench' -b 1M -e 1M -n 3 -w 1 -t ring" 2>&1)"
rc=$?
if [ "$rc" -eq 77 ]; then
  echo "$out"
  exit 77
fi
echo "$out" | grep -v "setpgid"
if [ "$rc" -ne 0 ]; then
  echo "FAIL: gossip_bench across 2 emulated nodes exited with $rc"
  exit 1
fi
if ! echo "$out" | grep -q '^links with a 20 ms queue: 4$'; then
  echo "FAIL: --queue-ms 20 did not give all 4 links (2 host-side, 2 node-side) a 20 ms queue"
  exit 1
fi
# The 1 MiB row of slot 0 (the pair [0,1], across the two nodes), no wrong elements.
if ! echo "$out" | grep -Eq '^ +1048576 +262144 +float \| +[0-9.]+ +[0-9.]+ +[0-9.]+ +0 \|'; then
  echo "FAIL: no 1 MiB result row with 0 wrong elements"
  exit 1
fi
if [ "$(leftovers)" != "$before" ]; then
  echo "FAIL: namespaces or interfaces left after a successful run"
  exit 1
fi

# Two nodes of two ranks, as MPI finds them: the all-reduce over all four takes the node-aware
# path (Note [node-aware all-reduce]) and gives exact results; with DECENT_DP_NODE_AWARE=0
# the flat ring does.
for node_aware in 1 0; do
  out="$("$cluster" --nodes 2 --ranks-per-node 2 --rate 1gbit -- \
    sh -c "\$EMU_MPIRUN -x DECENT_DP_NODE_AWARE=$node_aware -n 4 '$build/bin/gossip_bench' -b 1M -e 1M -n 2 -w 1 -t complete" 2>&1)"
  rc=$?
  echo "$out" | grep -v "setpgid"
  if [ "$rc" -ne 0 ]; then
    echo "FAIL: gossip_bench on 2 emulated nodes of 2 ranks (DECENT_DP_NODE_AWARE=$node_aware) exited with $rc"
    exit 1
  fi
  if ! echo "$out" | grep -Eq '^ +1048576 +262144 +float \| +[0-9.]+ +[0-9.]+ +[0-9.]+ +0 \|'; then
    echo "FAIL: no 1 MiB result row with 0 wrong elements (DECENT_DP_NODE_AWARE=$node_aware)"
    exit 1
  fi
  if [ "$node_aware" = 1 ]; then
    expected='node-aware [1-9]'
  else
    expected='ring [1-9][0-9]*, node-aware 0$'
  fi
  if ! echo "$out" | grep -Eq "^# rank 0's all-reduces by path: .*$expected"; then
    echo "FAIL: DECENT_DP_NODE_AWARE=$node_aware: expected '$expected' in the path counts"
    exit 1
  fi
done
if [ "$(leftovers)" != "$before" ]; then
  echo "FAIL: namespaces or interfaces left after the 2 x 2 runs"
  exit 1
fi

# calibrate on 2 nodes of 2 ranks: the blocks, then the stream of ring's exchanges whose
# time gives the pairs' share through the planner (Note [shares from a stream]).
cal_json="$(mktemp)"
out="$("$cluster" --nodes 2 --ranks-per-node 2 --rate 1gbit -- \
  sh -c "'$root/benchmarks/emulate/calibrate' --mpirun \"\$EMU_MPIRUN\" --lws 2 --nodes 2 --bytes 1M --iters 1 --repeats 1 --json '$cal_json'" 2>&1)"
rc=$?
echo "$out" | grep -v "setpgid"
if [ "$rc" -ne 0 ]; then
  rm -f "$cal_json"
  echo "FAIL: calibrate on 2 emulated nodes of 2 ranks exited with $rc"
  exit 1
fi
if ! python3 - "$cal_json" <<'PY'
import json, sys
f = json.load(open(sys.argv[1]))
ok = (0 < f["shared_efficiency"] <= 1 and 0 < f["block_shared_efficiency"] <= 1
      and f["stream_ring_ms"] > f["stream_compute_ms"] >= 0 and f["inter_bw_MBps"] > 0
      and f["intra_bw_MBps"] > 0 and f["ring_efficiency"] is None)
sys.exit(0 if ok else 1)
PY
then
  cat "$cal_json"
  rm -f "$cal_json"
  echo "FAIL: calibrate's JSON lacks a share in (0, 1], the stream's times or the links' rates"
  exit 1
fi
rm -f "$cal_json"
if [ "$(leftovers)" != "$before" ]; then
  echo "FAIL: namespaces or interfaces left after calibrate"
  exit 1
fi

"$cluster" --nodes 2 -- sh -c 'exit 3'
rc=$?
if [ "$rc" -ne 3 ]; then
  echo "FAIL: a failing command's status is not passed on: expected 3, got $rc"
  exit 1
fi
if [ "$(leftovers)" != "$before" ]; then
  echo "FAIL: namespaces or interfaces left after a failing command"
  exit 1
fi
"$cluster" --nodes 0 -- true 2>/dev/null
if [ $? -ne 2 ]; then
  echo "FAIL: --nodes 0 is not refused"
  exit 1
fi
"$cluster" --queue-ms 0 -- true 2>/dev/null
if [ $? -ne 2 ]; then
  echo "FAIL: --queue-ms 0 is not refused"
  exit 1
fi
echo "emulated cluster: run, failing command and teardown OK"
