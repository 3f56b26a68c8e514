#!/usr/bin/env bash
# build-guest.sh DEST — build, once, the QEMU guest the kernel-level e2e tests
# boot: QEMU 10 and Linux 6.12 from bookworm-backports (QEMU 7.2 in bookworm
# has no volatile CXL memory expander), a busybox initramfs that mounts the
# root, and a Debian bookworm ext4 root image. Safe to run again: it returns at
# once when DEST is complete and QEMU 10 is installed.
#
# DEST gets: vmlinuz, initrd.img, rootfs.ext4, versions.txt, .complete
set -euo pipefail
DEST=${1:?usage: build-guest.sh DEST}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BACKPORTS_LIST=/etc/apt/sources.list.d/memstrata-backports.list
# Only these two come from backports; everything else stays on bookworm.
QEMU_PKG=qemu-system-x86
KERNEL_META=linux-image-amd64
ROOTFS_PACKAGES=python3,python3-numpy,e2fsprogs,gdisk,dmsetup,util-linux,kmod,liburing2,libnuma1
# pydantic v2 is not in bookworm (1.10 is); the runtime's contracts need v2.
ROOTFS_WHEELS="pydantic>=2.7,<3 PyYAML>=6.0"
# What the initramfs must load to mount the root image and the 9p shares;
# everything else (nvme, cxl, dax, dm) is loaded from the root by guest-init.sh.
# ext4 finds its checksum through the crypto API, not modules.dep: crc32c_generic
# must be loaded first or mounting the root fails with ENOENT.
INITRAMFS_MODULES="virtio_pci virtio_blk crc32c_generic ext4 9pnet_virtio 9p"

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
log() { echo "build-guest: $*" >&2; }

ensure_backports() {
  if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    log "adding $BACKPORTS_LIST"
    echo "deb $MIRROR bookworm-backports main" | $SUDO tee "$BACKPORTS_LIST" >/dev/null
    $SUDO apt-get update -qq
  elif ! apt-cache policy "$QEMU_PKG" | grep -q bookworm-backports; then
    $SUDO apt-get update -qq
  fi
}

ensure_qemu() {
  if qemu-system-x86_64 --version 2>/dev/null | grep -q 'version 1[0-9]\.'; then return; fi
  ensure_backports
  log "installing $QEMU_PKG from bookworm-backports"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    -t bookworm-backports "$QEMU_PKG" >/dev/null
  qemu-system-x86_64 --version | head -1
}

ensure_qemu
"$ROOT/scripts/apt-install" debootstrap cpio kmod e2fsprogs xz-utils
[ -f "$DEST/.complete" ] && exit 0
ensure_backports

WORK="$DEST.tmp"
rm -rf "$WORK"; mkdir -p "$WORK"
cd "$WORK"

# --- kernel: extract, never install on the host --------------------------------
kpkg=$(apt-cache depends -t bookworm-backports "$KERNEL_META" | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[ -n "$kpkg" ] || { log "cannot resolve $KERNEL_META in bookworm-backports"; exit 1; }
log "downloading $kpkg and busybox-static"
mkdir debs && (cd debs && apt-get download -qq -o APT::Sandbox::User=root "$kpkg" busybox-static)
dpkg-deb -x debs/linux-image-*.deb kernel
dpkg-deb -x debs/busybox-static_*.deb busybox
moddir=""
for d in kernel/lib/modules/* kernel/usr/lib/modules/*; do [ -d "$d" ] && moddir=$d && break; done
[ -n "$moddir" ] || { log "no modules directory in $kpkg"; exit 1; }
kver=$(basename "$moddir")
cp kernel/boot/vmlinuz-"$kver" vmlinuz

# --- root filesystem -------------------------------------------------------------
log "debootstrap bookworm (minbase) — a few minutes"
$SUDO debootstrap --variant=minbase --include="$ROOTFS_PACKAGES" bookworm rootfs "$MIRROR" \
  > debootstrap.log 2>&1 || { tail -30 debootstrap.log; exit 1; }
mkdir -p rootfs/lib/modules
cp -a "$moddir" rootfs/lib/modules/
depmod -b rootfs "$kver"
python3 -m pip install -q --disable-pip-version-check --no-warn-conflicts --no-compile --only-binary=:all: \
  --python-version 3.11 --platform manylinux2014_x86_64 --implementation cp \
  --target rootfs/usr/local/lib/python3.11/dist-packages $ROOTFS_WHEELS
# Compiled once here by the guest's own python: tests run with the repo read-only
# and PYTHONDONTWRITEBYTECODE, and compiling pydantic on every TCG boot costs seconds.
$SUDO chroot rootfs python3 -m compileall -q /usr/local/lib/python3.11/dist-packages >/dev/null
# Mount points for the 9p shares (see e2e/node/README.md) and a quiet, small image.
mkdir -p rootfs/repo rootfs/out rootfs/ctl
echo memstrata-guest > rootfs/etc/hostname
rm -rf rootfs/var/cache/apt/archives/*.deb rootfs/var/lib/apt/lists/* \
  rootfs/usr/share/doc rootfs/usr/share/man rootfs/usr/share/locale rootfs/usr/share/info
size_mb=$(( $(du -sm rootfs | cut -f1) * 5 / 4 + 64 ))
mkfs.ext4 -q -F -L memstrata-root -d rootfs rootfs.ext4 "${size_mb}M"

# --- initramfs: busybox + the few modules that reach the root and the shares --------
mkdir -p initramfs/bin initramfs/modules initramfs/newroot initramfs/dev initramfs/proc initramfs/sys
cp busybox/bin/busybox initramfs/bin/busybox
for applet in sh mount umount insmod switch_root mkdir sleep echo cat poweroff; do
  ln -s busybox "initramfs/bin/$applet"
done
# modules.dep lists a module's dependencies; load them first, each once.
python3 - "$moddir" $INITRAMFS_MODULES > initramfs/modules/order <<'PY'
import sys, pathlib
moddir = pathlib.Path(sys.argv[1])
deps = {}
for line in (pathlib.Path("rootfs/lib/modules") / moddir.name / "modules.dep").read_text().splitlines():
    mod, _, rest = line.partition(":")
    deps[mod] = rest.split()
builtin = (pathlib.Path("rootfs/lib/modules") / moddir.name / "modules.builtin").read_text().split()
by_name = {pathlib.Path(m).name.split(".ko")[0].replace("-", "_"): m for m in deps}
order = []
def visit(path):
    for d in deps[path]:
        visit(d)
    if path not in order:
        order.append(path)
for name in sys.argv[2:]:
    if name in by_name:
        visit(by_name[name])
    elif not any(pathlib.Path(b).name.split(".ko")[0].replace("-", "_") == name for b in builtin):
        sys.exit(f"module {name} is neither a module nor built in")
print("\n".join(order))
PY
while read -r m; do
  f=$(basename "$m"); dst="initramfs/modules/${f%%.ko*}.ko"
  case "$f" in
    *.xz) xz -dc "$moddir/$m" > "$dst" ;;
    *.zst) zstd -qdc "$moddir/$m" > "$dst" ;;
    *) cp "$moddir/$m" "$dst" ;;
  esac
  echo "$(basename "$dst")" >> initramfs/modules/load
done < initramfs/modules/order
cp "$HERE/initramfs-init" initramfs/init
chmod +x initramfs/init
(cd initramfs && find . | cpio -o -H newc --quiet) > initrd.img

qver=$(qemu-system-x86_64 --version | head -1)
kpkgver=$(dpkg-deb -f debs/linux-image-*.deb Version)
cat > versions.txt <<EOF
qemu: $qver
kernel: $kpkg $kpkgver ($kver)
rootfs: debian bookworm minbase + $ROOTFS_PACKAGES + $ROOTFS_WHEELS
EOF

# Only the artifacts stay; the tree and the .debs are rebuilt from apt on demand.
$SUDO rm -rf rootfs kernel busybox debs initramfs
mkdir -p "$(dirname "$DEST")"
rm -rf "$DEST"; mv "$WORK" "$DEST"
touch "$DEST/.complete"
log "done: $DEST ($(du -sh "$DEST" | cut -f1))"
cat "$DEST/versions.txt"
