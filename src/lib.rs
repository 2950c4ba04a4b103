//! SeaweedFS CSI driver whose node plugin is itself the SeaweedFS client.
//!
//! Layers (each with its own error type, converted once at the boundary above it):
//! - [`filer`]: filer gRPC client (`filer_pb.SeaweedFiler`), metadata subscription.
//! - [`volume`]: volume-server HTTP client (assign/upload/read, JWT, cipher, gzip).
//! - [`chunks`]: the chunk model (visible intervals, manifests, truncation).
//! - [`cache`]: chunk cache (moka) and metadata cache.
//! - [`fs`]: filesystem logic, free of FUSE types.
//! - [`fuse`]: thin `fuser` adapter, session lifecycle, live-connection takeover.
//! - [`csi`]: CSI Identity/Controller/Node services.
pub mod budget;
pub mod cache;
pub mod chunks;
pub mod cli;
pub mod config;
pub mod csi;
pub mod driver;
pub mod filer;
pub mod fs;
pub mod fuse;
pub mod instrumented;
pub mod keeper;
pub mod metrics;
pub mod metrics_server;
pub mod pb;
pub mod retry;
pub mod security;
pub mod volume;
