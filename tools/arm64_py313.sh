#!/usr/bin/env bash
# Python 3.13 on emulated aarch64: a Debian trixie arm64 userland run under qemu-user, with the
# device side's aarch64 / cp313 wheels from the package registry. It checks that the torch-free
# runner installs and trains where most edge Linux boards are (ARM64, current Python).
#
#   tools/arm64_py313.sh check            # exit 0 if emulation can work here, else 3 + the reason
#   tools/arm64_py313.sh setup            # host tools (apt) + the userland (cached: once)
#   tools/arm64_py313.sh install REQ...   # pip-install aarch64/cp313 wheels into the userland's
#                                         # site folder (e.g. "dist/edgeadapt-0.1.0-py3-none-any.whl[device]")
#   tools/arm64_py313.sh run SCRIPT.py [ARGS...]   # run python3.13 under emulation (~50x slower)
#
# ARM64_ROOT: where the userland lives (default .cache/arm64-py313 in the checkout, ignored by
# git, so reruns skip the download). Needs qemu-user-static and mmdebstrap (installed with
# apt-get when missing and running as root) and a private mount namespace (unshare -m):
# onnxruntime's cpuinfo library aborts on the x86 /proc/cpuinfo that qemu-user passes through,
# so an ARM Cortex-A76-like one is bound over it for the emulated process only.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${ARM64_ROOT:-$HERE/.cache/arm64-py313}
# What the emulated interpreter needs beyond libc: the stdlib's C extensions' libraries and the
# C++ runtime that the onnxruntime wheel links.
PACKAGES=python3.13,libpython3.13-stdlib,libstdc++6,libgcc-s1,zlib1g,libexpat1,libffi8,libssl3t64,libbz2-1.0,liblzma5,libsqlite3-0

die() { echo "arm64_py313: $*" >&2; exit "${2:-1}"; }

qemu_bin() { command -v qemu-aarch64-static || command -v qemu-aarch64 || true; }

# Prints why emulation cannot work on this host (empty when it can).
why_not() {
  [ "$(uname -s)" = Linux ] || { echo "not Linux ($(uname -s))"; return; }
  if [ -z "$(qemu_bin)" ] || ! command -v mmdebstrap >/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "qemu-user-static/mmdebstrap missing and not root (cannot apt-get install)"; return; }
    command -v apt-get >/dev/null || { echo "qemu-user-static/mmdebstrap missing and no apt-get"; return; }
  fi
  unshare_m true 2>/dev/null || { echo "unshare of a mount namespace refused (a container without CAP_SYS_ADMIN)"; return; }
}

unshare_m() { if [ "$(id -u)" = 0 ]; then unshare -m "$@"; else unshare -r -m "$@"; fi; }

host_tools() {
  [ -n "$(qemu_bin)" ] && command -v mmdebstrap >/dev/null && return
  echo "arm64_py313: installing qemu-user-static and mmdebstrap (apt-get)" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-user-static mmdebstrap >/dev/null
}

userland() {
  [ -x "$ROOT/root/usr/bin/python3.13" ] && return
  mkdir -p "$ROOT"
  rm -rf "$ROOT/root.partial"
  echo "arm64_py313: building the trixie arm64 userland in $ROOT (log: $ROOT/mmdebstrap.log)" >&2
  # extract: the packages (and their dependencies) are unpacked only, so no arm64 code runs.
  mmdebstrap --variant=extract --architectures=arm64 --include="$PACKAGES" \
    trixie "$ROOT/root.partial" >"$ROOT/mmdebstrap.log" 2>&1 || die "mmdebstrap failed; see $ROOT/mmdebstrap.log"
  # merged /usr: the loader's path (/lib/ld-linux-aarch64.so.1) goes through /lib.
  for d in lib bin sbin; do [ -e "$ROOT/root.partial/$d" ] || ln -s "usr/$d" "$ROOT/root.partial/$d"; done
  mv "$ROOT/root.partial" "$ROOT/root"
}

cpuinfo() {
  local i
  for i in 0 1 2 3; do
    printf 'processor\t: %s\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n' "$i"
  done >"$ROOT/cpuinfo"
}

cmd=${1:-}; shift || true
case "$cmd" in
  check)
    reason=$(why_not)
    [ -z "$reason" ] || { echo "$reason"; exit 3; }
    echo "ok";;
  setup)
    reason=$(why_not)
    [ -z "$reason" ] || die "emulation not possible here: $reason" 3
    host_tools
    userland
    cpuinfo
    mkdir -p "$ROOT/site"
    echo "ready: $ROOT (python 3.13, aarch64)";;
  install)
    [ $# -gt 0 ] || die "install needs requirements (e.g. a wheel path with [device])" 2
    # The host's pip resolves for the target: aarch64 manylinux wheels for CPython 3.13 only.
    "${PIP_PYTHON:-python3}" -m pip install -q --disable-pip-version-check --target "$ROOT/site" \
      --upgrade --no-compile --only-binary :all: --implementation cp --python-version 3.13 \
      --abi cp313 --abi abi3 --abi none --platform manylinux_2_28_aarch64 \
      --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 --platform linux_aarch64 "$@";;
  run)
    [ -x "$ROOT/root/usr/bin/python3.13" ] || die "no userland in $ROOT: run '$0 setup' first" 2
    [ $# -gt 0 ] || die "run needs a script" 2
    QEMU=$(qemu_bin)
    # PYTHONPATH: only the installed site folder (plus EXTRA_PYTHONPATH when given), never the
    # host's; -I is not used so that PYTHONPATH counts, -s skips the user site.
    exec env -u PYTHONHOME -u PYTHONDONTWRITEBYTECODE QEMU_LD_PREFIX="$ROOT/root" \
      PYTHONPATH="${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$ROOT/site" \
      "$(command -v unshare)" $([ "$(id -u)" = 0 ] && echo -m || echo -r -m) \
      sh -c 'mount --bind "$1" /proc/cpuinfo && shift && exec "$@"' sh "$ROOT/cpuinfo" \
      "$QEMU" "$ROOT/root/usr/bin/python3.13" -s "$@";;
  *) sed -n 2,17p "$0"; exit 2;;
esac
