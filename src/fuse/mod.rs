//! Thin fuser adapter, session lifecycle and live-connection takeover.
pub mod memfs;
pub mod takeover;
