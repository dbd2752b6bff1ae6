#!/usr/bin/env bash
# Times README's first set-up command on a fresh Debian 12: a minimal
# debootstrap of bookworm in FOLDER (as root; needs debootstrap and Debian's
# mirror), a clone of this repository in it, Debian's `make` (the one
# package a minimal system lacks for it), then `make run` with its stages'
# times. The machine's cores and mirror are the chroot's; no compiler cache.
# Usage: sudo bash scripts/fresh-make-run.sh FOLDER   (FOLDER must not exist)
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: scripts/fresh-make-run.sh FOLDER (a folder that does not exist yet)" >&2; exit 2; }
root=$1
[ ! -e "$root" ] || { echo "fresh-make-run: $root exists; name a new folder" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "fresh-make-run: needs root (debootstrap, chroot, mount)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "fresh-make-run: needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)

trap 'umount -R "$root/proc" "$root/sys" "$root/dev" 2>/dev/null || true' EXIT
start=$(date +%s)
debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian > "$root.debootstrap.log" 2>&1
echo "fresh-make-run: debootstrap took $(( $(date +%s) - start )) s (not counted)"
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
git clone -q "$repo" "$root/root/memfit"
echo "fresh-make-run: memfit $(git -C "$root/root/memfit" log --oneline -1), $(nproc) cores"
start=$(date +%s)
chroot "$root" /bin/bash -c 'apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends make >/dev/null 2>&1'
echo "fresh-make-run: Debian's make took $(( $(date +%s) - start )) s"
chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /bin/bash -c 'cd /root/memfit && s=$(date +%s); make run > /root/make-run.log 2>&1; rc=$?;
                grep "^make: " /root/make-run.log; tail -n 12 /root/make-run.log | grep -E "^(final loss|test accuracy|peak memory)";
                echo "fresh-make-run: make run took $(( $(date +%s) - s )) s in all (exit $rc)"; exit $rc'
