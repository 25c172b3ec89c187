#!/usr/bin/env bash
# Print the address other nodes should use to reach this node: the source address of the
# route to ROUTE_PROBE_IP (default 8.8.8.8; nothing is sent, the kernel only picks the
# interface), else the first address of `hostname --all-ip-addresses` that is not loopback
# (127.x, ::1) or link-local (169.254.x, fe80::). `hostname --ip-address` alone can answer
# 127.0.1.1 (Debian's /etc/hosts) or an IPv6 link-local address that no other node reaches.
# Exit status 1 with a message when there is none.
set -euo pipefail

routable() {
    case $1 in
        127.* | 169.254.* | ::1 | fe80:* | FE80:* | "") return 1 ;;
        *) return 0 ;;
    esac
}

if command -v ip >/dev/null 2>&1; then
    src=$(ip -o route get "${ROUTE_PROBE_IP:-8.8.8.8}" 2>/dev/null | sed -n 's/.* src \([^ ]*\).*/\1/p' | head -n 1) || src=
    if routable "${src:-}"; then
        echo "$src"
        exit 0
    fi
fi

for address in $(hostname --all-ip-addresses 2>/dev/null || hostname --ip-address); do
    if routable "$address"; then
        echo "$address"
        exit 0
    fi
done
echo "error: no routable address on $(hostname); set HEAD_IP" >&2
exit 1
