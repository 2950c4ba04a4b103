#!/usr/bin/env bash
# Builds a fully static seaweedfs-csi-driver (glibc, +crt-static), checks that it is static
# and installs a copy without debug info (symbols kept for backtraces) at --out. Prints the
# installed path on stdout. Used by the Dockerfile and by tests/packaging_image.rs.
#
#   scripts/build-static.sh --out FILE [--target-dir DIR]
#
# glibc >= 2.34 has its `files` and `dns` NSS modules built in, so host names resolve through
# /etc/hosts and /etc/resolv.conf in an image that holds nothing but this binary.
#
# --target is given explicitly so RUSTFLAGS reach only the binary, not build scripts or proc
# macros (which must stay dynamic to be loaded by rustc).
set -euo pipefail

target_dir="${CARGO_TARGET_DIR:-target}"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --target-dir) target_dir="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

case "$(uname -m)" in
  x86_64) triple=x86_64-unknown-linux-gnu ;;
  aarch64) triple=aarch64-unknown-linux-gnu ;;
  *) echo "unsupported architecture $(uname -m)" >&2; exit 1 ;;
esac

[ -n "$out" ] || { echo "usage: $0 --out FILE [--target-dir DIR]" >&2; exit 2; }
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
cd "$(dirname "$0")/.."
# getrandom: call glibc's getrandom() directly. Its default looks the function up with dlsym,
# which finds nothing in a static binary, and then reads /dev/urandom, which a scratch image
# or a chroot need not have (the mount command died at start: "could not initialize
# ThreadRng: No such file or directory").
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static --cfg getrandom_backend=\"linux_getrandom\"" \
  cargo build --release --locked --target "$triple" --target-dir "$target_dir" \
  --bin seaweedfs-csi-driver >&2

bin="$target_dir/$triple/release/seaweedfs-csi-driver"
[ -x "$bin" ] || { echo "no binary at $bin" >&2; exit 1; }

# Static means: no program interpreter and no NEEDED libraries.
if readelf -lW "$bin" | grep -q 'Requesting program interpreter'; then
  echo "$bin has a program interpreter: not static" >&2
  readelf -lW "$bin" | grep interpreter >&2
  exit 1
fi
if readelf -dW "$bin" 2>/dev/null | grep -q '(NEEDED)'; then
  echo "$bin needs shared libraries:" >&2
  readelf -dW "$bin" | grep NEEDED >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
objcopy --strip-debug "$bin" "$out.tmp"
chmod 0755 "$out.tmp"
mv "$out.tmp" "$out"
"$out" --version >&2
echo "$out"
