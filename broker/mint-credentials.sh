#!/usr/bin/env bash
# Add MQTT users (devices or aggregators) to a Mosquitto password file with random passwords and
# print the broker URL each one should use.
#
#   broker/mint-credentials.sh [-f PASSWD] [-H HOST[:PORT]] [--ca PATH] [--force] NAME...
#   broker/mint-credentials.sh [-f PASSWD] [-H HOST[:PORT]] -n COUNT [-p PREFIX] [--start I]
#
#   umask 077; broker/mint-credentials.sh -f /etc/mosquitto/edge-fl/passwd -H broker.lan \
#       aggregator > aggregator.tsv
#   broker/mint-credentials.sh -f /etc/mosquitto/edge-fl/passwd -H broker.lan -n 50 > devices.tsv
#
# -n COUNT names devices d00000, d00001, ... (edge-fl's device ids: prefix d, 5 digits, the index
# of the device's data partition), from --start I (default 0); -p changes the prefix.
#
# Output (stdout, one line per user): NAME <TAB> mqtts://NAME:PASSWORD@HOST:PORT?ca=PATH
# (what `edge-fl fleet --credentials FILE` reads; --ca is the CA's path on the clients).
# Passwords are shown only here (the file stores salted hashes): keep the output private.
# NAME is the device id: the ACL (acl.template) lets a device write only <prefix>/<job>/up/NAME
# and <prefix>/<job>/status/NAME, so it must be [A-Za-z0-9_-] (no MQTT wildcards, no '/').
# Existing users are refused unless --force (re-keys them). Then: systemctl reload mosquitto.
#
#   broker/mint-credentials.sh [-f PASSWD] [--force] --ingest-workers N AGGREGATOR_TSV
#
# adds the aggregator's ingest workers (`edge-fl aggregator --workers N`): users NAME-w0 ..
# NAME-w(N-1) for the aggregator NAME of AGGREGATOR_TSV (its line as minted above), each with a
# password derived from the aggregator's (HMAC-SHA256 of "edge-fl ingest worker wI", 18 bytes,
# URL-safe base64), so the aggregator can start its workers as their own users (a broker with
# use_username_as_clientid allows one connection per user; the ACL gives each worker only its
# own ingest topics) and a worker's password reveals nothing of the aggregator's. Prints one line
# per worker (for workers run elsewhere: `edge-fl ingest --broker URL`). Re-key the workers
# (--force) whenever the aggregator is re-keyed.
# Note: each password is briefly visible to local users in mosquitto_passwd's command line.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-2}"; }
die() { echo "mint-credentials.sh: $*" >&2; exit 2; }

passwd_file=/etc/mosquitto/edge-fl/passwd
host="$(hostname -f 2>/dev/null || hostname)"
ca=/etc/edge-fl/ca.crt
force=0
count=""
prefix=d
start=0
workers=""
names=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -f|--file) passwd_file="${2:?-f needs a path}"; shift 2 ;;
        -H|--host) host="${2:?-H needs HOST[:PORT]}"; shift 2 ;;
        --ca) ca="${2:?--ca needs a path}"; shift 2 ;;
        --force) force=1; shift ;;
        -n|--count) count="${2:?-n needs a number}"; shift 2 ;;
        -p|--prefix) prefix="${2:?-p needs a prefix}"; shift 2 ;;
        --start) start="${2:?--start needs a number}"; shift 2 ;;
        --ingest-workers) workers="${2:?--ingest-workers needs a number}"; shift 2 ;;
        -h|--help) usage 0 ;;
        -*) echo "mint-credentials.sh: unknown option $1" >&2; usage ;;
        *) names+=("$1"); shift ;;
    esac
done
declare -A derived=()
if [[ -n "$workers" ]]; then
    [[ "$workers" =~ ^[0-9]+$ && "$workers" -gt 0 ]] || die "--ingest-workers N must be a positive integer, got '$workers'"
    [[ ${#names[@]} -eq 1 && -f "${names[0]}" ]] || die "--ingest-workers N takes the aggregator's line file (aggregator.tsv)"
    command -v openssl >/dev/null || die "openssl not found"
    IFS=$'\t' read -r agg url < "${names[0]}" || true
    [[ "$url" == *://*:*@* ]] || die "${names[0]}: expected NAME<TAB>mqtts://NAME:PASSWORD@HOST:PORT..."
    scheme="${url%%://*}"; rest="${url#*://}"; userinfo="${rest%%@*}"; where="${rest#*@}"
    agg_password="${userinfo#*:}"
    names=()
    for ((i = 0; i < workers; i++)); do
        user="$agg-w$i"
        names+=("$user")
        derived[$user]="$(printf 'edge-fl ingest worker w%d' "$i" \
            | openssl dgst -sha256 -hmac "$agg_password" -binary | head -c 18 | base64 | tr '+/' '-_')"
    done
fi
if [[ -n "$count" ]]; then
    [[ "$count" =~ ^[0-9]+$ && "$count" -gt 0 ]] || die "-n COUNT must be a positive integer, got '$count'"
    [[ "$start" =~ ^[0-9]+$ ]] || die "--start must be a non-negative integer, got '$start'"
    width=5  # edge_fl.job.device_id: d00000 (printf pads to at least 5 digits, like Python)
    for ((i = start; i < start + count; i++)); do names+=("$(printf '%s%0*d' "$prefix" "$width" "$i")"); done
fi
[[ ${#names[@]} -gt 0 ]] || { echo "mint-credentials.sh: give NAME... or -n COUNT" >&2; usage; }
command -v mosquitto_passwd >/dev/null || die "mosquitto_passwd not found (apt-get install mosquitto)"
[[ "$host" == *:* ]] || host="$host:8883"

for name in "${names[@]}"; do
    [[ "$name" =~ ^[A-Za-z0-9_-]{1,64}$ ]] || die "user name '$name' must match [A-Za-z0-9_-]{1,64}"
done
if [[ ! -f "$passwd_file" ]]; then
    mkdir -p "$(dirname "$passwd_file")"
    install -m 600 /dev/null "$passwd_file"
    echo "created $passwd_file (mode 600; make it readable by the mosquitto user)" >&2
fi
if [[ $force -eq 0 ]]; then
    for name in "${names[@]}"; do
        if grep -q "^${name}:" "$passwd_file"; then
            die "user '$name' already exists in $passwd_file (use --force to give it a new password)"
        fi
    done
fi

for name in "${names[@]}"; do
    if [[ -n "$workers" ]]; then
        password="${derived[$name]}"
        mosquitto_passwd -b "$passwd_file" "$name" "$password"
        printf '%s\t%s://%s:%s@%s\n' "$name" "$scheme" "$name" "$password" "$where"
        continue
    fi
    # 18 random bytes -> 24 URL-safe characters: no percent-encoding needed in the URL.
    password="$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')"
    mosquitto_passwd -b "$passwd_file" "$name" "$password"
    printf '%s\tmqtts://%s:%s@%s?ca=%s\n' "$name" "$name" "$password" "$host" "$ca"
done
echo "added ${#names[@]} user(s) to $passwd_file; reload the broker (systemctl reload mosquitto)" >&2
