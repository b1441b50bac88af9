#!/usr/bin/env bash
# Install the edge-fl device agent on a Raspberry Pi (or any systemd Linux) as a service.
#
#   sudo devices/raspberry-pi/install.sh [options] PACKAGE
#
#   PACKAGE               what pip installs: a path (wheel, sdist or source dir) or a requirement
#                         such as edge-fl==0.1.0
#   --index-url URL       package index for PACKAGE and its dependencies
#   --config FILE         device config to install as /etc/edge-fl/device.yaml
#                         (default: the example next to this script, if none is installed yet)
#   --ca FILE             CA certificate to install as /etc/edge-fl/ca.crt
#   --no-start            install and enable, but do not start the service now
#   --system-site-packages
#                         let the venv see Debian's Python packages (e.g. apt-get install
#                         python3-numpy first): pip then installs only what they do not satisfy
#
# Creates: system user edge-fl, venv /opt/edge-fl, /etc/edge-fl/, /var/lib/edge-fl (state),
# /etc/systemd/system/edge-fl-device.service (checked with systemd-analyze verify). Re-running
# upgrades the package and keeps config. Without a running systemd (a chroot or an image being
# built) the unit is enabled but not started: it starts on the next boot.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix=/opt/edge-fl
etc=/etc/edge-fl
user=edge-fl
unit=edge-fl-device.service

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-2}"; }
die() { echo "install.sh: $*" >&2; exit 1; }

package=""
index_url=""
config=""
ca=""
start=1
site_packages=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --index-url) index_url="${2:?--index-url needs a URL}"; shift 2 ;;
        --config) config="${2:?--config needs a file}"; shift 2 ;;
        --ca) ca="${2:?--ca needs a file}"; shift 2 ;;
        --no-start) start=0; shift ;;
        --system-site-packages) site_packages=(--system-site-packages); shift ;;
        -h|--help) usage 0 ;;
        -*) echo "install.sh: unknown option $1" >&2; usage ;;
        *) [[ -z "$package" ]] || die "only one PACKAGE, got '$package' and '$1'"; package="$1"; shift ;;
    esac
done
[[ -n "$package" ]] || { echo "install.sh: PACKAGE is required" >&2; usage; }
[[ $EUID -eq 0 ]] || die "run as root (sudo): it creates a system user and a systemd unit"
[[ -z "$config" || -f "$config" ]] || die "--config $config: no such file"
[[ -z "$ca" || -f "$ca" ]] || die "--ca $ca: no such file"
command -v systemctl >/dev/null || die "systemd is required"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "python3 >= 3.11 is required (Raspberry Pi OS bookworm or newer)"
python3 -c 'import venv, ensurepip' 2>/dev/null \
    || die "python3-venv is missing: apt-get install python3-venv"
# A path is resolved now: pip runs from another directory below.
if [[ -e "$package" ]]; then package="$(realpath "$package")"; fi

# 1. system user without login or home of its own (state lives in /var/lib/edge-fl)
if ! id -u "$user" >/dev/null 2>&1; then
    useradd --system --user-group --home-dir /var/lib/edge-fl --no-create-home \
        --shell /usr/sbin/nologin "$user"
    echo "created system user $user"
fi

# 2. virtualenv owned by root: the service can run it but not modify it
[[ -x "$prefix/bin/python" ]] || python3 -m venv "${site_packages[@]}" "$prefix"
pip_args=(--disable-pip-version-check --no-input)
[[ -z "$index_url" ]] || pip_args+=(--index-url "$index_url")
"$prefix/bin/pip" install "${pip_args[@]}" --upgrade pip
"$prefix/bin/pip" install "${pip_args[@]}" --upgrade "$package"
[[ -x "$prefix/bin/edge-fl" ]] || die "$package did not install an edge-fl command in $prefix/bin"
install -m 644 "$here/README.md" "$prefix/README.md"

# 3. config: readable by the service group only (it contains the MQTT password)
install -d -m 750 -o root -g "$user" "$etc"
if [[ -n "$config" ]]; then
    install -m 640 -o root -g "$user" "$config" "$etc/device.yaml"
elif [[ ! -f "$etc/device.yaml" ]]; then
    install -m 640 -o root -g "$user" "$here/device.yaml" "$etc/device.yaml"
    echo "installed the EXAMPLE config: edit $etc/device.yaml (broker.url, device.id, security.public_key)" >&2
    start=0
fi
[[ -z "$ca" ]] || install -m 644 "$ca" "$etc/ca.crt"

# 4. systemd unit. A unit systemd would reject must not be left enabled: verify it first
# (systemd-analyze comes with systemd; it checks keys, sections and that ExecStart exists).
install -m 644 "$here/$unit" "/etc/systemd/system/$unit"
if command -v systemd-analyze >/dev/null; then
    systemd-analyze verify "/etc/systemd/system/$unit" \
        || die "systemd-analyze verify rejects /etc/systemd/system/$unit (see above)"
fi
# sd_booted(3): systemd is PID 1 only if /run/systemd/system exists. In a chroot or an image
# being built there is no manager to reload or start: enable only (symlinks, works offline).
booted=0
if [[ -d /run/systemd/system ]]; then
    booted=1
    systemctl daemon-reload
fi
systemctl enable "$unit"
if [[ $booted -eq 0 ]]; then
    echo "enabled $unit; systemd is not running here (chroot?): it starts at the next boot"
elif [[ $start -eq 1 ]]; then
    systemctl restart "$unit"
    echo "started $unit: journalctl -u ${unit%.service} -f"
else
    echo "enabled $unit; start it with: systemctl start $unit"
fi
