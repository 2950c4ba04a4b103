//! Thin fuser adapter, session lifecycle and live-connection takeover.
pub mod adapter;
pub mod linger;
#[cfg(feature = "test-support")]
pub mod memfs;
pub mod mount_cmd;
pub mod session;
pub mod stager;
pub mod takeover;
