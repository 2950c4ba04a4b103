# syntax=docker/dockerfile:1
# seaweedfs-csi-driver: one static binary, nothing else. Mounts use mount(2) and /dev/fuse
# directly, so the image needs no shell, libfuse, fusermount, util-linux or weed.
#
#   docker build -t seaweedfs-csi-driver:0.1.0 .
#   docker buildx build --platform linux/amd64,linux/arm64 -t <registry>/seaweedfs-csi-driver:0.1.0 --push .
#
# Static linking uses glibc's static libc (+crt-static): the musl target is not required.
# The build stage runs on the builder's own platform and cross-compiles for TARGETARCH (no
# emulated compiler): scripts/build-static.sh --arch, the same path tests/packaging_image.rs
# takes for aarch64.

FROM --platform=$BUILDPLATFORM rust:1.95-bookworm AS build
ARG TARGETARCH
WORKDIR /src
RUN case "$TARGETARCH/$(uname -m)" in \
      arm64/x86_64) apt-get update && apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
        && rustup target add aarch64-unknown-linux-gnu ;; \
      amd64/aarch64) apt-get update && apt-get install -y --no-install-recommends gcc-x86-64-linux-gnu libc6-dev-amd64-cross \
        && rustup target add x86_64-unknown-linux-gnu ;; \
    esac
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
COPY src ./src
COPY scripts/build-static.sh ./scripts/build-static.sh
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    scripts/build-static.sh --arch "${TARGETARCH:-$(uname -m)}" --out /out/seaweedfs-csi-driver \
 && mkdir -m 1777 /out/tmp

FROM scratch
# /tmp exists for libraries that expect it; cache state goes to --cacheDir (a host path).
COPY --from=build /out/tmp /tmp
COPY --from=build /out/seaweedfs-csi-driver /seaweedfs-csi-driver
ENTRYPOINT ["/seaweedfs-csi-driver"]
