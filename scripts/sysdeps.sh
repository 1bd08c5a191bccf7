#!/usr/bin/env bash
# System libraries the Mooncake transfer engine links even for its TCP transport, and the
# tools the cross-host tests use (iproute2 for network namespaces, etcd as a metadata server).
# Idempotent: installs only what is missing, and only as root (else says what to run).
set -euo pipefail
need=()
for pair in libibverbs.so.1:libibverbs1 libnl-route-3.so.200:libnl-route-3-200 librdmacm.so.1:librdmacm1; do
    lib=${pair%%:*}; pkg=${pair##*:}
    ldconfig -p | grep -q "$lib" || need+=("$pkg")
done
# optional (the cross-host tests skip without them, saying why): iproute2 for network
# namespaces, etcd as a Mooncake metadata server
optional=()
for pair in ip:iproute2 ss:iproute2 etcd:etcd-server; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || optional+=("${pair##*:}")
done
if [ "$(id -u)" -ne 0 ]; then
    if [ ${#need[@]} -ne 0 ]; then
        echo "kvbridge: missing system libraries for Mooncake; run as root: apt-get install -y ${need[*]}" >&2
        exit 1
    fi
    [ ${#optional[@]} -eq 0 ] || echo "kvbridge: cross-host tests will skip; as root: apt-get install -y ${optional[*]}" >&2
    exit 0
fi
need+=("${optional[@]}")
[ ${#need[@]} -eq 0 ] && exit 0
mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
echo "kvbridge: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
