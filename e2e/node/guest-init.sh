#!/bin/bash
# Init of the memstrata test guest, run as PID 1 from the read-only repo share
# (/repo) after the initramfs has mounted the root image. It builds the node a
# user would have — a CPU-less CXL NUMA node online as memory, four NVMe
# namespaces in the states the safety rules care about — then runs the test
# script the launcher put in /ctl and powers off.
#
# Mount points: /repo  the repository (9p, read-only)
#               /out   files the test script writes for the host (9p, read-write)
#               /ctl   launcher <-> init: script.py in; stdout, stderr,
#                      exit_status, init.log, timings out (9p, read-write)
# Namespaces:   nsid 1 free (all zeroes), nsid 2 ext4, nsid 3 GPT with one
#               partition, nsid 4 held by device-mapper target "memstrata-hold".
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8

console() { echo "memstrata-guest: $*" > /dev/console; }
power_off() { sync; echo o > /proc/sysrq-trigger; sleep 10; exit 1; }

mount_early() {
  mountpoint -q /proc || mount -t proc proc /proc
  mountpoint -q /sys || mount -t sysfs sys /sys
  mountpoint -q /dev || mount -t devtmpfs dev /dev
  mkdir -p /dev/pts /dev/shm
  mount -t devpts devpts /dev/pts
  mount -t tmpfs tmpfs /dev/shm
  mount -t tmpfs tmpfs /run
  mount -t tmpfs tmpfs /tmp
  local share
  for share in out ctl; do
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 "$share" "/$share" \
      || { console "cannot mount the 9p share '$share'"; power_off; }
  done
}

mount_early
exec 3>&1 4>&2 >>/ctl/init.log 2>&1
stamp() { local up; read -r up _ < /proc/uptime; echo "$1 $up" >> /ctl/timings; }
stamp init_start
# `memstrata.trace` on the kernel command line traces every step with a timestamp.
if grep -qw memstrata.trace /proc/cmdline; then PS4='+ $EPOCHREALTIME '; set -x; fi
# Errors from here on stop the setup, are logged with what failed, and reach
# the launcher as setup_failed (it raises rather than run a half-built node).
die() {
  echo "SETUP FAILED: $*"
  echo "$*" > /ctl/setup_failed
  console "setup failed: $*"
  power_off
}
wait_for() {  # wait_for SECONDS TEST... — poll until TEST succeeds
  local deadline=$(( EPOCHSECONDS + $1 )); shift
  until "$@"; do
    [ "$EPOCHSECONDS" -ge "$deadline" ] && return 1
    sleep 0.1
  done
}

load_modules() {
  # No udev in the guest: load the drivers this node's devices need by name.
  modprobe -a nvme dm_mod cxl_acpi cxl_pci cxl_port cxl_mem dax_cxl device_dax kmem \
    || die "modprobe of nvme/cxl/dax/dm modules failed"
}

# Every fork+exec costs ~0.1-0.2 s on TCG, so the helpers below read sysfs with
# the `read` builtin and return results in variables rather than $(...).
attr() { read -r REPLY < "$1"; }  # attr FILE — first line of FILE into $REPLY

# --- CXL: a volatile region over the whole memdev, onlined as a NUMA node ------
find_decoders() {
  # The root decoder is the one that can create RAM regions; endpoint decoders
  # are the only ones with a DPA mode (mem0 is the one memdev, so its first is ours).
  ROOT_DECODER="" EP_DECODER=""
  local d
  for d in /sys/bus/cxl/devices/decoder*; do
    [ -z "$ROOT_DECODER" ] && [ -e "$d/create_ram_region" ] && ROOT_DECODER=${d##*/}
    [ -z "$EP_DECODER" ] && [ -e "$d/mode" ] && [ -e "$d/dpa_size" ] && EP_DECODER=${d##*/}
  done
  [ -n "$ROOT_DECODER" ] && [ -n "$EP_DECODER" ]
}
find_cxl_node() {
  # The region's node: CPU-less, with online memory, and not one QEMU's -numa made (0, 1).
  CXL_NODE=""
  local n
  for n in /sys/devices/system/node/node*; do
    [ "${n##*node}" -le 1 ] && continue
    attr "$n/cpulist"; [ -z "$REPLY" ] || continue
    attr "$n/meminfo"; set -- $REPLY  # "Node N MemTotal: KB kB": online memory only
    [ "${4:-0}" -gt 0 ] || continue
    CXL_NODE=${n##*node}; return 0
  done
  return 1
}
setup_cxl_region() {
  local cxl=/sys/bus/cxl/devices size region
  wait_for 20 test -e $cxl/mem0/ram/size || die "CXL memdev mem0 did not appear"
  wait_for 20 find_decoders || die "no CXL root decoder with create_ram_region or endpoint decoder for mem0"
  attr $cxl/mem0/ram/size; size=$(( REPLY ))
  [ "$size" -gt 0 ] || die "CXL mem0 has no volatile capacity"
  attr $cxl/$ROOT_DECODER/create_ram_region; region=$REPLY
  echo "$region" > $cxl/$ROOT_DECODER/create_ram_region || die "create_ram_region $region on $ROOT_DECODER"
  echo 1 > $cxl/$region/interleave_ways || die "$region interleave_ways"
  attr $cxl/$ROOT_DECODER/interleave_granularity
  echo "$REPLY" > $cxl/$region/interleave_granularity || die "$region interleave_granularity"
  echo ram > $cxl/$EP_DECODER/mode || die "$EP_DECODER mode=ram"
  echo "$size" > $cxl/$EP_DECODER/dpa_size || die "$EP_DECODER dpa_size=$size"
  echo "$size" > $cxl/$region/size || die "$region size=$size"
  echo "$EP_DECODER" > $cxl/$region/target0 || die "$region target0=$EP_DECODER"
  echo 1 > $cxl/$region/commit || die "$region commit"
  # Hot-added blocks come online movable: what a CXL expander is for.
  echo online_movable > /sys/devices/system/memory/auto_online_blocks
  echo "$region" > /sys/bus/cxl/drivers/cxl_region/bind || die "bind $region to cxl_region"
  wait_for 20 find_cxl_node || die "CXL region $region did not come online as a NUMA node"
  echo "CXL: $region ($size bytes) on $ROOT_DECODER via $EP_DECODER; node $CXL_NODE"
}
online_remaining_blocks() {
  local b
  for b in /sys/devices/system/memory/memory*; do
    attr "$b/state"
    [ "$REPLY" = offline ] && echo online_movable > "$b/state"
  done
  return 0
}

# --- NVMe: four namespaces in the states the safety rules distinguish ------------
find_namespaces() {
  # Namespaces are scanned asynchronously, so nvme0nY is not nsid Y: map by nsid.
  NS=()
  local b
  for b in /sys/block/nvme0n*; do
    [ -e "$b/nsid" ] || continue
    attr "$b/nsid"; NS[$REPLY]=${b##*/}
  done
  [ -n "${NS[1]:-}" ] && [ -n "${NS[2]:-}" ] && [ -n "${NS[3]:-}" ] && [ -n "${NS[4]:-}" ]
}
setup_nvme() {
  wait_for 20 find_namespaces || die "NVMe namespaces 1-4 did not all appear: $(ls /sys/block)"
  mkfs.ext4 -q -F -L memstrata-ns2 "/dev/${NS[2]}" || die "mkfs.ext4 /dev/${NS[2]}"
  sgdisk -n 1:0:0 -c 1:memstrata-ns3 "/dev/${NS[3]}" > /dev/null || die "sgdisk /dev/${NS[3]}"
  wait_for 10 test -e "/sys/block/${NS[3]}/${NS[3]}p1" || die "/dev/${NS[3]} partition 1 not in sysfs"
  attr "/sys/block/${NS[4]}/size"
  DM_DISABLE_UDEV=1 dmsetup create --noudevsync memstrata-hold \
    --table "0 $REPLY linear /dev/${NS[4]} 0" || die "dmsetup create over /dev/${NS[4]}"
  # What a node's udev makes of block devices (root:disk 0660; this guest has no udev): the node agent offers
  # only what the training pod's user and group (uid 1000, group 6) can open.
  chown 0:6 "/dev/${NS[1]}" "/dev/${NS[2]}" "/dev/${NS[3]}" "/dev/${NS[4]}" || die "chown of the namespaces"
  chmod 0660 "/dev/${NS[1]}" "/dev/${NS[2]}" "/dev/${NS[3]}" "/dev/${NS[4]}" || die "chmod of the namespaces"
  echo "NVMe: nsid 1 free ${NS[1]}, nsid 2 ext4 ${NS[2]}, nsid 3 gpt ${NS[3]}, nsid 4 dm-held ${NS[4]}"
}

load_modules
stamp modules
setup_cxl_region
online_remaining_blocks
stamp cxl
setup_nvme
stamp nvme

if [ ! -f /ctl/script.py ]; then
  die "no /ctl/script.py to run"
fi
stamp script_start
(
  cd /tmp
  export PYTHONPATH=/repo/runtime:/repo/operator:/repo
  export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 MEMSTRATA_OUT=/out MEMSTRATA_IN_GUEST=1
  exec python3 /ctl/script.py > /ctl/stdout 2> /ctl/stderr
)
rc=$?
stamp script_end
echo "$rc" > /ctl/exit_status
# A second channel for the status, in case the share lost the file.
console "MEMSTRATA_EXIT_STATUS=$rc"
power_off
