//! Thin fuser adapter, session lifecycle and live-connection takeover.
pub mod adapter;
pub mod mount_cmd;
pub mod session;
pub mod stager;
