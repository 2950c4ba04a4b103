//! CSI services.
