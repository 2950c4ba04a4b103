//! fd-keeper role: holds duplicates of live /dev/fuse fds across plugin restarts.
//!
//! `seaweedfs-csi-driver keeper --socket=/path` is a tiny single-threaded process that owns
//! no FUSE logic. A FUSE connection stays alive while any process holds its `/dev/fuse` fd, so
//! while the keeper holds a dup, a crash or upgrade of the daemon leaves every mount in place;
//! the successor fetches the fd and the metadata blob and adopts the connection
//! (`crate::fuse::takeover`).
//!
//! # Protocol
//! Unix `SOCK_SEQPACKET`; every message is one small JSON object, fds travel as SCM_RIGHTS.
//! The metadata blob (InitParams + whatever the filesystem hands to its successor) travels as a
//! sealed memfd (write/grow/shrink sealed, so it is immutable and can be handed out many
//! times), which keeps every message small whatever the blob's size ([`MAX_BLOB`]).
//!
//! | request | fds sent | answer |
//! |---|---|---|
//! | `put{id}` | blob, fuse fds... | `ok`; replaces the entry, sender becomes owner |
//! | `update_blob{id}` | blob | `ok` |
//! | `get{id}` | - | `entry` + blob, dups of the fuse fds |
//! | `claim{id}` | - | like `get`, but only once no *other live connection* owns the entry; the claimer becomes owner |
//! | `list` | - | `ids` |
//! | `drop{id}` | - | `ok`; closes the fds (the session is over) |
//! | `notifier{id, token}` | - | `ok`; the connection then carries raw kernel invalidations ([`notify`]) |
//!
//! Ownership is a property of the keeper *connection*: it ends when that connection closes,
//! which for a daemon that keeps its [`KeeperClient`] for its whole life means the daemon has
//! exited (all its threads are gone before its fds are closed). So a granted `claim` tells a
//! successor that the old daemon cannot be mid-request any more: the moment to adopt and send
//! FUSE_NOTIFY_RESEND. It also stops two daemons from serving one connection at once.
//!
//! # Robustness
//! * Never blocks on a client: sockets are non-blocking and a request gets exactly one small
//!   answer; a client whose receive buffer is full is disconnected.
//! * The one blocking thing it does, writing a session's kernel invalidations (which can wait
//!   for a request the daemon has not answered), happens on a thread per notifier connection,
//!   outside the request loop.
//! * Client crashes only close their connection (ownership released, pending claims served).
//! * Only peers with the keeper's uid (or root) are served; the socket file is mode 0600.
//! * Restarting the keeper is safe only while it holds nothing: its fds are the only thing
//!   keeping a connection alive during a daemon outage. If the keeper dies, the fds are gone;
//!   running daemons are unaffected, but a daemon that then dies takes its mount with it
//!   (ENOTCONN) and the CSI node falls back to remount + rebind. On SIGTERM/SIGINT the keeper
//!   therefore only exits once it holds no entries (drain), and it refuses to start on a socket
//!   another keeper is listening on.

mod client;
pub mod notify;
mod protocol;
mod server;
#[cfg(test)]
mod tests;

pub use client::{KeeperClient, KeptEntry, DEFAULT_TIMEOUT, RECONNECT_BUDGET};
pub use notify::KeeperNotifier;
pub use protocol::{MAX_BLOB, MAX_FDS_PER_ENTRY};
pub use server::{run, KeeperArgs, KeeperServer};

use std::io;

use nix::errno::Errno;

#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("keeper i/o: {0}")]
    Io(#[from] io::Error),
    #[error("keeper has no entry {0:?}")]
    NotFound(String),
    #[error("keeper entry {0:?} is owned by another live connection")]
    Busy(String),
    #[error("keeper rejected the request: {0}")]
    Rejected(String),
    #[error("keeper protocol error: {0}")]
    Protocol(String),
    #[error("timed out waiting for the keeper")]
    Timeout,
}

impl From<Errno> for KeeperError {
    fn from(e: Errno) -> Self {
        KeeperError::Io(e.into())
    }
}
