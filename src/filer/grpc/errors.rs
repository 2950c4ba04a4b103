//! Mapping the filer's gRPC statuses and error texts to typed [`FilerError`]s, in one place.

use tonic::{Code, Status};

use crate::filer::FilerError;
use crate::pb::filer as pb;

pub(super) fn is_transport(s: &Status) -> bool {
    match s.code() {
        // hyper reports a connection dropped before/while sending as "operation was canceled"
        Code::Unavailable | Code::Cancelled => true,
        Code::Unknown | Code::Internal => {
            let m = s.message();
            m.contains("transport error")
                || m.contains("h2 protocol error")
                || m.contains("connection")
                || m.contains("broken pipe")
                || m.contains("tcp connect error")
        }
        _ => false,
    }
}

pub(super) fn is_not_found_msg(m: &str) -> bool {
    m.contains("no entry is found") || m.contains("not found")
}

/// Generic status mapping; op-specific text matches happen before this.
pub(super) fn status_err(op: &str, s: Status) -> FilerError {
    let msg = format!("{op}: {}", s.message());
    if is_transport(&s) {
        return FilerError::Unavailable(format!("{msg} ({:?})", s.code()));
    }
    match s.code() {
        Code::DeadlineExceeded => FilerError::Timeout(msg),
        Code::NotFound => FilerError::NotFound(msg),
        Code::AlreadyExists => FilerError::AlreadyExists(msg),
        Code::InvalidArgument => FilerError::InvalidArgument(msg),
        Code::FailedPrecondition if s.message().starts_with("precondition failed") => {
            FilerError::Changed(msg)
        }
        _ if s.message().contains("no entry is found") => FilerError::NotFound(msg),
        code => FilerError::Other(format!("{msg} ({code:?})")),
    }
}

pub(super) fn create_err(path: &str, code: pb::FilerError, text: &str) -> FilerError {
    let msg = format!("create {path}: {text}");
    match code {
        pb::FilerError::EntryAlreadyExists | pb::FilerError::ExistingIsFile => {
            FilerError::AlreadyExists(msg)
        }
        pb::FilerError::ExistingIsDirectory => FilerError::IsADirectory(msg),
        pb::FilerError::ParentIsFile => FilerError::NotADirectory(msg),
        pb::FilerError::EntryNameTooLong => FilerError::NameTooLong(msg),
        pb::FilerError::PreconditionFailed => FilerError::Changed(msg),
        pb::FilerError::Ok => {
            if text.contains("already exists") {
                FilerError::AlreadyExists(msg)
            } else if text.contains("name too long") {
                FilerError::NameTooLong(msg)
            } else {
                FilerError::Other(msg)
            }
        }
    }
}

/// The filer's text for a [`pb::WriteCondition`] that did not hold (what a streamed update's
/// error carries instead of a status code).
pub(super) fn is_precondition_msg(text: &str) -> bool {
    text.contains("code = FailedPrecondition desc = precondition failed")
}

pub(super) fn update_err(path: &str, s: Status) -> FilerError {
    if !is_transport(&s) && s.code() != Code::FailedPrecondition && is_not_found_msg(s.message()) {
        return FilerError::NotFound(format!("update {path}: {}", s.message()));
    }
    status_err("update", s)
}

pub(super) fn delete_err(path: &str, text: &str) -> FilerError {
    let msg = format!("delete {path}: {text}");
    if text.contains("non-empty") || text.contains("not empty") {
        FilerError::NotEmpty(msg)
    } else if text.contains("no entry is found") {
        FilerError::NotFound(msg)
    } else {
        FilerError::Other(msg)
    }
}

pub(super) fn rename_text_err(what: &str, text: &str) -> FilerError {
    let msg = format!("rename {what}: {text}");
    if is_not_found_msg(text) {
        FilerError::NotFound(msg)
    } else if text.contains("is not empty") || text.contains("not empty") {
        FilerError::NotEmpty(msg)
    } else if text.contains("not directory") || text.contains("not a directory") {
        FilerError::NotADirectory(msg)
    } else {
        FilerError::Other(msg)
    }
}

pub(super) fn rename_err(what: &str, s: Status) -> FilerError {
    if is_transport(&s) || s.code() == Code::DeadlineExceeded {
        return status_err("rename", s);
    }
    rename_text_err(what, s.message())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_errors() {
        assert!(matches!(
            status_err(
                "lookup",
                Status::unknown("filer: no entry is found in filer store")
            ),
            FilerError::NotFound(_)
        ));
        assert!(matches!(
            status_err("x", Status::unavailable("tcp connect error")),
            FilerError::Unavailable(_)
        ));
        assert!(matches!(
            status_err("x", Status::unknown("transport error")),
            FilerError::Unavailable(_)
        ));
        assert!(matches!(
            status_err("x", Status::deadline_exceeded("slow")),
            FilerError::Timeout(_)
        ));
        assert!(matches!(
            status_err("x", Status::internal("boom")),
            FilerError::Other(_)
        ));
        assert!(matches!(
            update_err(
                "/a",
                Status::unknown("not found /a: filer: no entry is found in filer store")
            ),
            FilerError::NotFound(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::EntryAlreadyExists, "x"),
            FilerError::AlreadyExists(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::ExistingIsDirectory, "x"),
            FilerError::IsADirectory(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::ParentIsFile, "x"),
            FilerError::NotADirectory(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::EntryNameTooLong, "x"),
            FilerError::NameTooLong(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::Ok, "weird"),
            FilerError::Other(_)
        ));
        assert!(matches!(
            delete_err("/a", "fail to delete non-empty folder: /a"),
            FilerError::NotEmpty(_)
        ));
        assert!(matches!(
            delete_err("/a", "disk on fire"),
            FilerError::Other(_)
        ));
        assert!(matches!(
            rename_text_err("a", "entry not found"),
            FilerError::NotFound(_)
        ));
        assert!(matches!(
            rename_text_err("a", "filer: no entry is found in filer store"),
            FilerError::NotFound(_)
        ));
        assert!(matches!(
            rename_text_err("a", "target /b is not empty"),
            FilerError::NotEmpty(_)
        ));
        assert!(matches!(
            rename_text_err("a", "/b is not directory"),
            FilerError::NotADirectory(_)
        ));
        assert!(matches!(
            rename_err("a", Status::unavailable("down")),
            FilerError::Unavailable(_)
        ));
    }
}
