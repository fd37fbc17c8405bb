#!/usr/bin/env bash
# Run a command and say how much more of a disk it used at its peak than before it started:
# the disk's used MiB (df -Pm) sampled every DISK_PEAK_EVERY seconds (default 5) while it runs.
# What else writes to that disk meanwhile counts too: run it on an otherwise idle machine.
#   scripts/disk-peak.sh [--disk PATH] COMMAND [ARGS]   (PATH: default the current folder)
# The command's own output and exit status pass through; the figure goes to stderr last:
#   disk-peak: 6673 MiB above the start at most on the disk of /tmp/x (start 29641 MiB used, ...)
set -euo pipefail
disk=.
if [ "${1:-}" = --disk ]; then
  disk=$2
  shift 2
fi
[ $# -gt 0 ] || { echo "usage: scripts/disk-peak.sh [--disk PATH] COMMAND [ARGS]" >&2; exit 2; }
every=${DISK_PEAK_EVERY:-5}
used() { df -Pm "$disk" | awk 'NR == 2 { print $3 }'; }
start=$(used)
samples=$(mktemp "${TMPDIR:-/tmp}/disk-peak.XXXXXX")
trap 'rm -f "$samples"' EXIT
(while :; do used >> "$samples"; sleep "$every"; done) &
sampler=$!
status=0
"$@" || status=$?
used >> "$samples"
kill "$sampler" 2>/dev/null || true
wait "$sampler" 2>/dev/null || true
peak=$(sort -n "$samples" | tail -n 1)
echo "disk-peak: $((peak - start)) MiB above the start at most on the disk of $(cd "$disk" && pwd)" \
  "(start $start MiB used, peak $peak, end $(used); sampled every $every s)" >&2
exit "$status"
