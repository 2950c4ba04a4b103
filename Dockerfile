# syntax=docker/dockerfile:1
# seaweedfs-csi-driver: one static binary, nothing else. Mounts use mount(2) and /dev/fuse
# directly, so the image needs no shell, libfuse, fusermount, util-linux or weed.
#
#   docker build -t seaweedfs-csi-driver:0.1.0 .
#
# Static linking uses glibc's static libc (+crt-static): the musl target is not required.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
COPY src ./src
COPY scripts/build-static.sh ./scripts/build-static.sh
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    scripts/build-static.sh --out /out/seaweedfs-csi-driver \
 && mkdir -m 1777 /out/tmp

FROM scratch
# /tmp exists for libraries that expect it; cache state goes to --cacheDir (a host path).
COPY --from=build /out/tmp /tmp
COPY --from=build /out/seaweedfs-csi-driver /seaweedfs-csi-driver
ENTRYPOINT ["/seaweedfs-csi-driver"]
