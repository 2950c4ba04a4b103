#!/usr/bin/env bash
# Installs, on Debian 12, what `scripts/build-static.sh --arch aarch64` needs to cross-compile
# the static binary and what the test needs to run it (qemu-user):
#   - gcc-aarch64-linux-gnu: C parts (ring), the link, and the static libc.a;
#   - a Rust standard library for aarch64: rustup's when `rustup target add` works, else
#     Debian's rustc-web + cargo-web with libstd-rust-web-dev:arm64 (same compiler version);
#   - qemu-user: runs the aarch64 binary on this machine.
# Idempotent; installs nothing that is already there. Needs root (apt-get).
#
#   scripts/cross-deps.sh [aarch64]
set -euo pipefail
arch="${1:-aarch64}"
case "$arch" in
  aarch64 | arm64) triple=aarch64-unknown-linux-gnu deb_arch=arm64 ;;
  *) echo "cross-deps: only aarch64 is supported, not $arch" >&2; exit 2 ;;
esac

has_std() { [ -n "$(ls "$("$1" --print target-libdir --target "$triple" 2>/dev/null)"/libstd-*.rlib 2>/dev/null)" ]; }

pkgs=()
command -v aarch64-linux-gnu-gcc >/dev/null || pkgs+=(gcc-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || pkgs+=(qemu-user)
if ! has_std rustc && ! has_std /usr/bin/rustc; then
  # rustup needs the internet; Debian's packaged toolchain does not.
  if ! rustup target add "$triple" >/dev/null 2>&1 || ! has_std rustc; then
    pkgs+=(rustc-web cargo-web "libstd-rust-web-dev:$deb_arch")
  fi
fi
((${#pkgs[@]})) || exit 0
export DEBIAN_FRONTEND=noninteractive
dpkg --print-foreign-architectures | grep -qx "$deb_arch" || dpkg --add-architecture "$deb_arch"
apt-get update -qq
apt-get install -y -qq "${pkgs[@]}"
