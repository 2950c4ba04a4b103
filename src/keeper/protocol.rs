//! The keeper's wire format: request and answer messages, sending and receiving them with
//! their fds (SCM_RIGHTS), and the sealed memfd that carries the metadata blob.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{Deserialize, Serialize};

use super::KeeperError;

/// Largest metadata blob accepted.
pub const MAX_BLOB: u64 = 64 << 20;
/// Most fuse fds per entry (one per connection clone; normally 1).
pub const MAX_FDS_PER_ENTRY: usize = 16;
pub(super) const MAX_ID_LEN: usize = 1024;
pub(super) const MAX_MSG: usize = 64 * 1024;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum Request {
    /// `token` names the session (kept across adoptions in its blob): a drop that carries
    /// another session's token leaves the entry (absent in older clients: no check).
    Put {
        id: String,
        #[serde(default)]
        token: Option<u64>,
    },
    UpdateBlob {
        id: String,
    },
    Get {
        id: String,
    },
    Claim {
        id: String,
    },
    List,
    /// Turns this connection into a notifier for the session `id` (see
    /// [`super::notify`]); refused unless `token` is the entry's (a request without one is
    /// refused for an entry that has one).
    Notifier {
        id: String,
        #[serde(default)]
        token: Option<u64>,
    },
    Drop {
        id: String,
        #[serde(default)]
        token: Option<u64>,
    },
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum ErrKind {
    NotFound,
    Busy,
    Invalid,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "r", rename_all = "snake_case")]
pub(super) enum Response {
    Ok,
    /// Followed by fds: the blob memfd, then `nfds` fuse fds.
    Entry {
        nfds: usize,
        owner_alive: bool,
    },
    Ids {
        ids: Vec<String>,
    },
    Err {
        kind: ErrKind,
        message: String,
    },
}

// ---------------------------------------------------------------------------------------------
// Messages with fds

/// poll(2) over `fds` (fd, wanted events; `None` = skip the slot); returns the received
/// events per slot. `timeout_ms` < 0 waits forever. (libc directly: the crate's nix build
/// has no `poll` feature.)
pub(super) fn poll_fds(
    fds: &[(Option<BorrowedFd<'_>>, i16)],
    timeout_ms: i32,
) -> nix::Result<Vec<i16>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|(fd, ev)| libc::pollfd {
            // poll ignores negative fds (a skipped slot would otherwise still report HUP).
            fd: fd.map_or(-1, |f| f.as_raw_fd()),
            events: *ev,
            revents: 0,
        })
        .collect();
    // SAFETY: pfds is a valid array of pollfd for the duration of the call.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
    Errno::result(n)?;
    Ok(pfds.iter().map(|p| p.revents).collect())
}

pub(super) fn send_msg(
    sock: BorrowedFd<'_>,
    payload: &[u8],
    fds: &[RawFd],
    flags: MsgFlags,
) -> nix::Result<()> {
    let iov = [IoSlice::new(payload)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    sendmsg::<()>(
        sock.as_raw_fd(),
        &iov,
        cmsgs,
        flags | MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// Receives one message. `Ok(None)` = peer closed. Truncated messages are an error (and their
/// fds are closed).
pub(super) fn recv_msg(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    flags: MsgFlags,
) -> nix::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut cmsg_space = nix::cmsg_space!([RawFd; MAX_FDS_PER_ENTRY + 1]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg_space),
        flags | MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            // SAFETY: SCM_RIGHTS installed these fds in our table just now; nobody else owns them.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let (bytes, truncated) = (
        msg.bytes,
        msg.flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC),
    );
    if truncated {
        return Err(Errno::EMSGSIZE);
    }
    if bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((bytes, fds)))
}

/// A sealed memfd holding `blob`.
pub(super) fn blob_to_memfd(blob: &[u8]) -> io::Result<OwnedFd> {
    if blob.len() as u64 > MAX_BLOB {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("blob of {} bytes exceeds {MAX_BLOB}", blob.len()),
        ));
    }
    let fd = memfd_create(
        c"keeper-blob",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )?;
    let mut f = File::from(fd);
    f.write_all(blob)?;
    fcntl(
        &f,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_WRITE
                | SealFlag::F_SEAL_SEAL,
        ),
    )?;
    Ok(OwnedFd::from(f))
}

/// Checks that `fd` is an immutable (sealed) blob of acceptable size; returns its size.
pub(super) fn check_sealed(fd: BorrowedFd<'_>) -> Result<u64, String> {
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS)
        .map_err(|e| format!("blob fd is not a sealable memfd: {e}"))?;
    let need = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE;
    if !SealFlag::from_bits_truncate(seals).contains(need) {
        return Err("blob memfd is not sealed against writes".into());
    }
    let st = nix::sys::stat::fstat(fd).map_err(|e| format!("fstat blob: {e}"))?;
    let size = st.st_size as u64;
    if size > MAX_BLOB {
        return Err(format!("blob of {size} bytes exceeds {MAX_BLOB}"));
    }
    Ok(size)
}

pub(super) fn read_blob(fd: OwnedFd) -> Result<Vec<u8>, KeeperError> {
    let size = check_sealed(fd.as_fd()).map_err(KeeperError::Protocol)?;
    let f = File::from(fd);
    let mut buf = vec![0u8; size as usize];
    // Positional reads: the open file (and its offset) is shared with other receivers.
    f.read_exact_at(&mut buf, 0)?;
    Ok(buf)
}

pub(super) fn validate_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(format!("id must be 1..={MAX_ID_LEN} bytes"));
    }
    Ok(())
}
