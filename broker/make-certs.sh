#!/usr/bin/env bash
# Make a private CA, a broker certificate and optional client certificates for edge-fl (openssl).
#
#   broker/make-certs.sh [-o OUTDIR] [-d DAYS] [--client NAME]... HOST_OR_IP [HOST_OR_IP...]
#
#   broker/make-certs.sh -o certs broker.lan 192.168.1.10         # CA + server cert
#   broker/make-certs.sh -o certs --client d00001 broker.lan       # + client cert for d00001
#
# Every HOST_OR_IP goes into the server certificate's subjectAltName: clients verify the name
# they connect to (the host in mqtts://HOST:8883) against it, so list every name and address
# devices will use. An existing CA in OUTDIR is reused, so client certificates can be added later
# without re-provisioning every device's ca.crt. Keys are EC P-256 (cheap on a Raspberry Pi).
#
# Output: ca.crt ca.key server.crt server.key [client-NAME.crt client-NAME.key]
# Devices get only ca.crt (and their own client-NAME.*). Keep ca.key offline.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-2}"; }

outdir=.
days=825
clients=()
names=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -o|--out) outdir="${2:?-o needs a directory}"; shift 2 ;;
        -d|--days) days="${2:?-d needs a number of days}"; shift 2 ;;
        --client) clients+=("${2:?--client needs a name}"); shift 2 ;;
        -h|--help) usage 0 ;;
        -*) echo "make-certs.sh: unknown option $1" >&2; usage ;;
        *) names+=("$1"); shift ;;
    esac
done
[[ ${#names[@]} -gt 0 ]] || { echo "make-certs.sh: give at least one HOST_OR_IP for the broker" >&2; usage; }
[[ "$days" =~ ^[0-9]+$ && "$days" -gt 0 ]] || { echo "make-certs.sh: -d DAYS must be a positive integer, got '$days'" >&2; exit 2; }
command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found" >&2; exit 1; }

mkdir -p "$outdir"
cd "$outdir"
umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# sign NAME CN EXTENSIONS: NAME.key + NAME.crt signed by ca.key
sign() {
    newkey "$1.key"
    openssl req -new -key "$1.key" -subj "/CN=$2" -out "$tmp/$1.csr"
    printf '%s\n' "$3" > "$tmp/$1.ext"
    openssl x509 -req -in "$tmp/$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
        -days "$days" -sha256 -extfile "$tmp/$1.ext" -out "$1.crt" 2>/dev/null
    chmod 644 "$1.crt"
}

if [[ -f ca.key && -f ca.crt ]]; then
    echo "reusing CA $(pwd)/ca.crt" >&2
else
    newkey ca.key
    openssl req -x509 -new -key ca.key -sha256 -days "$((days * 2))" -subj "/CN=edge-fl private CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.crt
    chmod 644 ca.crt
fi

san=()
for name in "${names[@]}"; do
    if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then san+=("IP:$name"); else san+=("DNS:$name"); fi
done
san_list=$(IFS=,; echo "${san[*]}")
common="basicConstraints=critical,CA:FALSE
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer"
sign server "${names[0]}" "$common
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san_list"
echo "server certificate for $san_list: $(pwd)/server.crt" >&2

for client in "${clients[@]+"${clients[@]}"}"; do
    [[ "$client" =~ ^[A-Za-z0-9_-]{1,64}$ ]] || { echo "make-certs.sh: client name '$client' must match [A-Za-z0-9_-]{1,64}" >&2; exit 2; }
    sign "client-$client" "$client" "$common
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
    echo "client certificate (CN=$client): $(pwd)/client-$client.crt" >&2
done
