#!/usr/bin/env bash
# System libraries the Mooncake transfer engine links even for its TCP transport.
# Idempotent: installs only what is missing, and only as root (else says what to run).
set -euo pipefail
need=()
for pair in libibverbs.so.1:libibverbs1 libnl-route-3.so.200:libnl-route-3-200 librdmacm.so.1:librdmacm1; do
    lib=${pair%%:*}; pkg=${pair##*:}
    ldconfig -p | grep -q "$lib" || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "kvbridge: missing system libraries for Mooncake; run as root: apt-get install -y ${need[*]}" >&2
    exit 1
fi
echo "kvbridge: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
