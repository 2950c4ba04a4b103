//! CSI services: one file per service ([`identity`], [`controller`], [`node`]), the gRPC server
//! ([`server`]), mount helpers ([`mounts`]), parameter handling ([`params`]) and the seam to the
//! FUSE layer ([`stager`]), this node's topology ([`topology`]).

pub mod authority;
pub mod controller;
pub mod identity;
pub mod mounts;
pub mod node;
pub mod params;
pub mod server;
pub mod stager;
pub mod state;
pub mod topology;

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use tonic::Status;

use crate::pb::csi::volume_capability::access_mode::Mode;
use crate::pb::csi::volume_capability::AccessType;
use crate::pb::csi::VolumeCapability;

/// Default CSI driver name (`--driverName`).
pub const DEFAULT_DRIVER_NAME: &str = "seaweedfs-csi-driver";
/// Reported as `vendor_version`.
pub const VENDOR_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Every access mode we serve: a SeaweedFS volume is a shared filesystem, so any mix of
/// readers and writers on any number of nodes works.
pub const SUPPORTED_ACCESS_MODES: &[Mode] = &[
    Mode::SingleNodeWriter,
    Mode::SingleNodeReaderOnly,
    Mode::MultiNodeReaderOnly,
    Mode::MultiNodeSingleWriter,
    Mode::MultiNodeMultiWriter,
    Mode::SingleNodeSingleWriter,
    Mode::SingleNodeMultiWriter,
];

/// What a validated [`VolumeCapability`] asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapabilityRequest {
    pub mode: Mode,
    pub mount_flags: Vec<String>,
}

impl CapabilityRequest {
    /// Reader-only modes get a read-only FUSE session.
    pub fn read_only_mode(&self) -> bool {
        matches!(
            self.mode,
            Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly
        )
    }

    /// `ro` or `readOnly` among the CSI mount flags (PV `mountOptions`).
    pub fn ro_flag(&self) -> bool {
        self.mount_flags
            .iter()
            .any(|f| params::READ_ONLY_FLAGS.contains(&f.trim()))
    }
}

/// Message for block requests, shared so every RPC says the same thing.
pub const BLOCK_UNSUPPORTED: &str =
    "block access type is not supported: SeaweedFS volumes are filesystems, use volumeMode: Filesystem";

/// Checks one capability; the error is a human-readable reason.
pub fn check_capability(cap: &VolumeCapability) -> Result<CapabilityRequest, String> {
    let mount_flags = match &cap.access_type {
        Some(AccessType::Mount(m)) => m.mount_flags.clone(),
        Some(AccessType::Block(_)) => return Err(BLOCK_UNSUPPORTED.to_string()),
        None => return Err("volume capability has no access type (mount is required)".to_string()),
    };
    let raw = cap.access_mode.as_ref().map(|m| m.mode).unwrap_or(0);
    let mode = Mode::try_from(raw).map_err(|_| format!("unknown access mode {raw}"))?;
    if mode == Mode::Unknown {
        return Err("volume capability has no access mode".to_string());
    }
    if !SUPPORTED_ACCESS_MODES.contains(&mode) {
        return Err(format!(
            "access mode {} is not supported",
            mode.as_str_name()
        ));
    }
    Ok(CapabilityRequest { mode, mount_flags })
}

/// [`check_capability`] for RPCs where a bad capability is the caller's error.
pub(crate) fn require_capability(
    cap: Option<&VolumeCapability>,
) -> Result<CapabilityRequest, Status> {
    let cap = cap.ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
    check_capability(cap).map_err(Status::invalid_argument)
}

pub(crate) fn require_field(value: &str, name: &str) -> Result<(), Status> {
    if value.trim().is_empty() {
        Err(Status::invalid_argument(format!("{name} is required")))
    } else {
        Ok(())
    }
}

/// Per-key async locks (one per volume), so operations on different volumes never wait for each
/// other while calls for the same volume run one at a time.
#[derive(Default)]
pub struct KeyedLocks {
    map: parking_lot::Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl KeyedLocks {
    pub fn new() -> Self {
        Self::default()
    }

    pub async fn lock(&self, key: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = {
            let mut map = self.map.lock();
            let existing = map.get(key).and_then(Weak::upgrade);
            match existing {
                Some(m) => m,
                None => {
                    let m = Arc::new(tokio::sync::Mutex::new(()));
                    // Drop entries nobody holds any more, so the map stays as small as the set
                    // of volumes being worked on.
                    if map.len() >= 64 {
                        map.retain(|_, w| w.strong_count() > 0);
                    }
                    map.insert(key.to_string(), Arc::downgrade(&m));
                    m
                }
            }
        };
        m.lock_owned().await
    }

    /// Number of keys currently tracked (tests).
    pub fn tracked(&self) -> usize {
        let mut map = self.map.lock();
        map.retain(|_, w| w.strong_count() > 0);
        map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::csi::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(access: Option<AccessType>, mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: access,
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    #[test]
    fn capabilities() {
        let mount = || {
            Some(AccessType::Mount(MountVolume {
                mount_flags: vec!["ro".into()],
                ..Default::default()
            }))
        };
        for m in SUPPORTED_ACCESS_MODES {
            assert!(check_capability(&cap(mount(), *m)).is_ok());
        }
        let r = check_capability(&cap(mount(), Mode::MultiNodeReaderOnly)).unwrap();
        assert!(r.read_only_mode() && r.ro_flag());
        assert!(check_capability(&cap(
            Some(AccessType::Block(BlockVolume {})),
            Mode::SingleNodeWriter
        ))
        .unwrap_err()
        .contains("block"));
        assert!(check_capability(&cap(None, Mode::SingleNodeWriter)).is_err());
        assert!(check_capability(&cap(mount(), Mode::Unknown)).is_err());
        let bogus = VolumeCapability {
            access_type: mount(),
            access_mode: Some(AccessMode { mode: 99 }),
        };
        assert!(check_capability(&bogus).is_err());
    }

    #[tokio::test]
    async fn keyed_locks_serialise_per_key_only() {
        let locks = Arc::new(KeyedLocks::new());
        let a = locks.lock("a").await;
        // Another key is free.
        let b = tokio::time::timeout(std::time::Duration::from_millis(100), locks.lock("b")).await;
        assert!(b.is_ok());
        // The same key waits.
        let again =
            tokio::time::timeout(std::time::Duration::from_millis(100), locks.lock("a")).await;
        assert!(again.is_err());
        drop(a);
        drop(b);
        let _a2 = locks.lock("a").await;
        assert_eq!(locks.tracked(), 1);
    }
}
