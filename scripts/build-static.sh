#!/usr/bin/env bash
# Builds a fully static seaweedfs-csi-driver (glibc, +crt-static), checks that it is static
# and installs a copy without debug info (symbols kept for backtraces) at --out. Prints the
# installed path on stdout. Used by the Dockerfile and by tests/packaging_image.rs.
#
#   scripts/build-static.sh --out FILE [--target-dir DIR] [--arch x86_64|aarch64]
#
# --arch defaults to this machine's. Another one cross-compiles: the C parts (ring) and the
# link use Debian's cross gcc (gcc-aarch64-linux-gnu, whose libc6-dev-arm64-cross has the
# static libc.a), and the compiler must have that target's standard library. rustup's does
# after `rustup target add`; where rustup cannot fetch it (no internet), Debian's rustc-web
# with libstd-rust-web-dev:<arch> is used (scripts/cross-deps.sh installs both).
#
# glibc >= 2.34 has its `files` and `dns` NSS modules built in, so host names resolve through
# /etc/hosts and /etc/resolv.conf in an image that holds nothing but this binary.
#
# --target is given explicitly so RUSTFLAGS reach only the binary, not build scripts or proc
# macros (which must stay dynamic to be loaded by rustc).
set -euo pipefail

target_dir="${CARGO_TARGET_DIR:-target}"
out=""
arch="$(uname -m)"
while [ $# -gt 0 ]; do
  case "$1" in
    --target-dir) target_dir="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

case "$arch" in
  x86_64 | amd64) arch=x86_64 ;;
  aarch64 | arm64) arch=aarch64 ;;
  *) echo "unsupported architecture $arch (x86_64 or aarch64)" >&2; exit 1 ;;
esac
triple="$arch-unknown-linux-gnu"
cargo=cargo
objcopy=objcopy
if [ "$arch" != "$(uname -m)" ]; then
  gcc="$arch-linux-gnu-gcc"
  command -v "$gcc" >/dev/null || {
    echo "cross build for $arch needs $gcc: scripts/cross-deps.sh $arch installs it" >&2
    exit 1
  }
  objcopy="$arch-linux-gnu-objcopy"
  env_triple="${triple//-/_}"
  upper="${env_triple^^}"
  export "CARGO_TARGET_${upper}_LINKER=$gcc" "CC_${env_triple}=$gcc" "AR_${env_triple}=$arch-linux-gnu-ar"
  # The compiler with this target's standard library: rustup's, else Debian's rustc-web.
  has_std() { [ -n "$(ls "$("$1" --print target-libdir --target "$triple" 2>/dev/null)"/libstd-*.rlib 2>/dev/null)" ]; }
  if ! has_std "${RUSTC:-rustc}"; then
    if has_std /usr/bin/rustc && [ -x /usr/bin/cargo ]; then
      export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
      cargo=/usr/bin/cargo
    else
      echo "no standard library for $triple: rustup target add $triple, or scripts/cross-deps.sh $arch" >&2
      exit 1
    fi
  fi
  echo "cross-compiling for $triple with $("${RUSTC:-rustc}" --version)" >&2
fi

[ -n "$out" ] || { echo "usage: $0 --out FILE [--target-dir DIR]" >&2; exit 2; }
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
cd "$(dirname "$0")/.."
# getrandom: call glibc's getrandom() directly. Its default looks the function up with dlsym,
# which finds nothing in a static binary, and then reads /dev/urandom, which a scratch image
# or a chroot need not have (the mount command died at start: "could not initialize
# ThreadRng: No such file or directory").
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static --cfg getrandom_backend=\"linux_getrandom\"" \
  "$cargo" build --release --locked --target "$triple" --target-dir "$target_dir" \
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
"$objcopy" --strip-debug "$bin" "$out.tmp"
chmod 0755 "$out.tmp"
mv "$out.tmp" "$out"
if [ "$arch" = "$(uname -m)" ]; then "$out" --version >&2; fi
echo "$out"
