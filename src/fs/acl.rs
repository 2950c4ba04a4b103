//! POSIX ACLs in their Linux xattr form (`system.posix_acl_access` / `_default`): parsing,
//! validation and the mode arithmetic a filesystem owes the kernel once it negotiates
//! `FUSE_POSIX_ACL` (the kernel caches and enforces ACLs; the filesystem keeps the mode in sync
//! and applies default-ACL inheritance on create).
//!
//! Wire form: little-endian `u32` version 2, then entries of `{tag: u16, perm: u16, id: u32}`.

pub const ACCESS: &str = "system.posix_acl_access";
pub const DEFAULT: &str = "system.posix_acl_default";

const VERSION: u32 = 2;
const HEADER_LEN: usize = 4;
const ENTRY_LEN: usize = 8;
/// The id written for entries that name nobody (the kernel's `ACL_UNDEFINED_ID`).
pub const UNDEFINED_ID: u32 = u32::MAX;

pub const USER_OBJ: u16 = 0x01;
pub const USER: u16 = 0x02;
pub const GROUP_OBJ: u16 = 0x04;
pub const GROUP: u16 = 0x08;
pub const MASK: u16 = 0x10;
pub const OTHER: u16 = 0x20;

/// A malformed ACL; always reported as EINVAL, as the kernel does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AclError {
    #[error("ACL of {0} bytes is not a header plus whole entries")]
    Length(usize),
    #[error("ACL version {0} (want 2)")]
    Version(u32),
    #[error("unknown ACL tag {0:#x}")]
    Tag(u16),
    #[error("ACL permission {0:#o} has bits other than rwx")]
    Perm(u16),
    #[error("ACL entries out of order, duplicated or incomplete")]
    Structure,
    #[error("ACL with named entries has no mask")]
    NoMask,
}

impl AclError {
    pub fn errno(&self) -> i32 {
        libc::EINVAL
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AclEntry {
    pub tag: u16,
    pub perm: u16,
    pub id: u32,
}

/// A parsed ACL. Empty means "header only", which the kernel treats as removal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acl {
    pub entries: Vec<AclEntry>,
}

/// What a new node gets from its parent's default ACL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inherited {
    /// The requested mode with its rwx bits masked by the ACL (other bits untouched).
    pub mode: u32,
    /// `None` when the inherited ACL is equivalent to `mode`.
    pub access: Option<Acl>,
    /// Directories inherit the default ACL itself.
    pub default: Option<Acl>,
}

impl Acl {
    /// Parses and validates the xattr form (the rules of the kernel's `posix_acl_valid`).
    pub fn parse(b: &[u8]) -> Result<Acl, AclError> {
        if b.len() < HEADER_LEN || (b.len() - HEADER_LEN) % ENTRY_LEN != 0 {
            return Err(AclError::Length(b.len()));
        }
        let version = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if version != VERSION {
            return Err(AclError::Version(version));
        }
        let entries: Vec<AclEntry> = b[HEADER_LEN..]
            .chunks_exact(ENTRY_LEN)
            .map(|c| AclEntry {
                tag: u16::from_le_bytes([c[0], c[1]]),
                perm: u16::from_le_bytes([c[2], c[3]]),
                id: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect();
        let acl = Acl { entries };
        acl.validate()?;
        Ok(acl)
    }

    fn validate(&self) -> Result<(), AclError> {
        if self.entries.is_empty() {
            return Ok(());
        }
        // Entries must come as USER_OBJ, USER*, GROUP_OBJ, GROUP*, [MASK], OTHER, named ones
        // sorted by id without duplicates; the state is the next allowed section.
        let mut state = USER_OBJ;
        let mut last_id: Option<u32> = None;
        let mut named = false;
        let mut mask = false;
        for e in &self.entries {
            if e.perm & !7 != 0 {
                return Err(AclError::Perm(e.perm));
            }
            match e.tag {
                USER_OBJ if state == USER_OBJ => state = USER,
                USER | GROUP if state == e.tag => {
                    if last_id.is_some_and(|l| e.id <= l) {
                        return Err(AclError::Structure);
                    }
                    last_id = Some(e.id);
                    named = true;
                }
                GROUP_OBJ if state == USER => {
                    state = GROUP;
                    last_id = None;
                }
                MASK if state == GROUP => {
                    state = OTHER;
                    mask = true;
                }
                OTHER if state == OTHER || state == GROUP => state = 0,
                USER_OBJ | USER | GROUP_OBJ | GROUP | MASK | OTHER => {
                    return Err(AclError::Structure)
                }
                t => return Err(AclError::Tag(t)),
            }
        }
        if state != 0 {
            return Err(AclError::Structure);
        }
        if named && !mask {
            return Err(AclError::NoMask);
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN + ENTRY_LEN * self.entries.len());
        b.extend_from_slice(&VERSION.to_le_bytes());
        for e in &self.entries {
            b.extend_from_slice(&e.tag.to_le_bytes());
            b.extend_from_slice(&e.perm.to_le_bytes());
            b.extend_from_slice(&e.id.to_le_bytes());
        }
        b
    }

    fn perm_of(&self, tag: u16) -> Option<u32> {
        self.entries
            .iter()
            .find(|e| e.tag == tag)
            .map(|e| u32::from(e.perm))
    }

    /// The rwx bits (0o777) the ACL implies: owner = USER_OBJ, group = MASK if present else
    /// GROUP_OBJ, other = OTHER.
    pub fn mode_bits(&self) -> u32 {
        let user = self.perm_of(USER_OBJ).unwrap_or(0);
        let group = self
            .perm_of(MASK)
            .or_else(|| self.perm_of(GROUP_OBJ))
            .unwrap_or(0);
        let other = self.perm_of(OTHER).unwrap_or(0);
        user << 6 | group << 3 | other
    }

    /// Whether the mode bits say it all (only the three base entries), so no xattr is needed.
    pub fn is_equivalent_to_mode(&self) -> bool {
        self.entries
            .iter()
            .all(|e| matches!(e.tag, USER_OBJ | GROUP_OBJ | OTHER))
    }

    /// chmod: the owner, group class (the mask if any, else the owning group) and other
    /// entries take the new mode's bits; named entries are kept.
    pub fn chmod(&mut self, mode: u32) {
        let has_mask = self.entries.iter().any(|e| e.tag == MASK);
        for e in &mut self.entries {
            match e.tag {
                USER_OBJ => e.perm = ((mode >> 6) & 7) as u16,
                MASK => e.perm = ((mode >> 3) & 7) as u16,
                GROUP_OBJ if !has_mask => e.perm = ((mode >> 3) & 7) as u16,
                OTHER => e.perm = (mode & 7) as u16,
                _ => {}
            }
        }
    }

    /// Inheritance on create (POSIX.1e, the kernel's `posix_acl_create`): the child's access
    /// ACL is the parent's default ACL with its owner, group class and other entries limited
    /// by the requested mode, and the mode's rwx bits are limited by the ACL in turn. The umask
    /// does not apply. Directories also inherit the default ACL as their own.
    pub fn inherit(parent_default: &Acl, mode: u32, is_dir: bool) -> Inherited {
        let mut acl = parent_default.clone();
        let mut mode = mode;
        let has_mask = acl.entries.iter().any(|e| e.tag == MASK);
        for e in &mut acl.entries {
            let (shift, limits) = match e.tag {
                USER_OBJ => (6, true),
                OTHER => (0, true),
                MASK => (3, true),
                GROUP_OBJ => (3, !has_mask),
                _ => (0, false),
            };
            if limits {
                e.perm &= ((mode >> shift) & 7) as u16;
                mode &= !(0o7 << shift) | (u32::from(e.perm) << shift);
            }
        }
        Inherited {
            mode,
            access: (!acl.is_equivalent_to_mode()).then_some(acl),
            default: is_dir.then(|| parent_default.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(tag: u16, perm: u16, id: u32) -> AclEntry {
        AclEntry { tag, perm, id }
    }

    fn acl(entries: &[AclEntry]) -> Acl {
        Acl {
            entries: entries.to_vec(),
        }
    }

    /// user::rw- user:65534:r-- group::r-- mask::r-- other::---
    fn named() -> Acl {
        acl(&[
            e(USER_OBJ, 6, UNDEFINED_ID),
            e(USER, 4, 65534),
            e(GROUP_OBJ, 4, UNDEFINED_ID),
            e(MASK, 4, UNDEFINED_ID),
            e(OTHER, 0, UNDEFINED_ID),
        ])
    }

    fn base(u: u16, g: u16, o: u16) -> Acl {
        acl(&[
            e(USER_OBJ, u, UNDEFINED_ID),
            e(GROUP_OBJ, g, UNDEFINED_ID),
            e(OTHER, o, UNDEFINED_ID),
        ])
    }

    #[test]
    fn round_trips_the_wire_form() {
        let a = named();
        let b = a.to_bytes();
        assert_eq!(b.len(), 4 + 5 * 8);
        assert_eq!(&b[..4], &[2, 0, 0, 0]);
        // second entry: tag 2, perm 4, id 65534, little-endian
        assert_eq!(&b[12..20], &[2, 0, 4, 0, 0xfe, 0xff, 0, 0]);
        assert_eq!(Acl::parse(&b).unwrap(), a);
        // header only: an empty ACL
        assert!(Acl::parse(&[2, 0, 0, 0]).unwrap().is_empty());
    }

    #[test]
    fn rejects_malformed_input() {
        let good = named().to_bytes();
        let einval = |b: &[u8]| Acl::parse(b).unwrap_err().errno();
        assert_eq!(einval(&[]), libc::EINVAL);
        assert_eq!(einval(&[2, 0, 0]), libc::EINVAL);
        assert_eq!(einval(&good[..good.len() - 1]), libc::EINVAL);
        assert_eq!(Acl::parse(&[1, 0, 0, 0]).unwrap_err(), AclError::Version(1));
        let mut bad_perm = good.clone();
        bad_perm[6] = 8; // USER_OBJ perm with a bit beyond rwx
        assert_eq!(Acl::parse(&bad_perm).unwrap_err(), AclError::Perm(8));
        let mut bad_tag = good.clone();
        bad_tag[12] = 0x40;
        assert_eq!(Acl::parse(&bad_tag).unwrap_err(), AclError::Tag(0x40));
        let check = |a: Acl| Acl::parse(&a.to_bytes()).unwrap_err();
        // missing OTHER / USER_OBJ / GROUP_OBJ
        assert_eq!(
            check(acl(&[e(USER_OBJ, 6, 0), e(GROUP_OBJ, 4, 0)])),
            AclError::Structure
        );
        assert_eq!(
            check(acl(&[e(GROUP_OBJ, 4, 0), e(OTHER, 4, 0)])),
            AclError::Structure
        );
        assert_eq!(
            check(acl(&[e(USER_OBJ, 6, 0), e(OTHER, 4, 0)])),
            AclError::Structure
        );
        // named entries need a mask
        assert_eq!(
            check(acl(&[
                e(USER_OBJ, 6, 0),
                e(USER, 4, 7),
                e(GROUP_OBJ, 4, 0),
                e(OTHER, 0, 0)
            ])),
            AclError::NoMask
        );
        // named users unsorted or duplicated
        for ids in [[9, 7], [7, 7]] {
            assert_eq!(
                check(acl(&[
                    e(USER_OBJ, 6, 0),
                    e(USER, 4, ids[0]),
                    e(USER, 4, ids[1]),
                    e(GROUP_OBJ, 4, 0),
                    e(MASK, 4, 0),
                    e(OTHER, 0, 0)
                ])),
                AclError::Structure
            );
        }
        // wrong order, duplicate base entry, entry after OTHER
        assert_eq!(
            check(acl(&[
                e(GROUP_OBJ, 4, 0),
                e(USER_OBJ, 6, 0),
                e(OTHER, 0, 0)
            ])),
            AclError::Structure
        );
        assert_eq!(
            check(acl(&[
                e(USER_OBJ, 6, 0),
                e(USER_OBJ, 6, 0),
                e(GROUP_OBJ, 4, 0),
                e(OTHER, 0, 0)
            ])),
            AclError::Structure
        );
        let mut trailing = base(6, 4, 4);
        trailing.entries.push(e(MASK, 4, 0));
        assert_eq!(check(trailing), AclError::Structure);
        // a mask alone is fine without named entries
        let with_mask = acl(&[
            e(USER_OBJ, 6, 0),
            e(GROUP_OBJ, 4, 0),
            e(MASK, 4, 0),
            e(OTHER, 0, 0),
        ]);
        assert!(Acl::parse(&with_mask.to_bytes()).is_ok());
    }

    #[test]
    fn mode_comes_from_owner_mask_and_other() {
        assert_eq!(named().mode_bits(), 0o640);
        assert_eq!(base(7, 5, 1).mode_bits(), 0o751);
        let mut m = named();
        m.entries[3].perm = 7; // mask rwx, group_obj r--
        assert_eq!(m.mode_bits(), 0o670);
    }

    #[test]
    fn equivalence_is_only_the_base_entries() {
        assert!(base(6, 4, 4).is_equivalent_to_mode());
        assert!(!named().is_equivalent_to_mode());
        let mask_only = acl(&[
            e(USER_OBJ, 6, 0),
            e(GROUP_OBJ, 4, 0),
            e(MASK, 4, 0),
            e(OTHER, 0, 0),
        ]);
        assert!(!mask_only.is_equivalent_to_mode());
    }

    #[test]
    fn chmod_updates_owner_group_class_and_other() {
        let mut a = named();
        a.chmod(0o751);
        assert_eq!(a.mode_bits(), 0o751);
        // the mask took the group bits; the owning group and named user kept theirs
        assert_eq!(a.entries[2].perm, 4);
        assert_eq!(a.entries[1], e(USER, 4, 65534));
        assert_eq!(a.entries[3].perm, 5);
        let mut b = base(6, 4, 4);
        b.chmod(0o700);
        assert_eq!(b, base(7, 0, 0));
    }

    #[test]
    fn inheritance_masks_acl_and_mode() {
        // default: user::rwx user:65534:rwx group::r-x mask::rwx other::r-x
        let d = acl(&[
            e(USER_OBJ, 7, UNDEFINED_ID),
            e(USER, 7, 65534),
            e(GROUP_OBJ, 5, UNDEFINED_ID),
            e(MASK, 7, UNDEFINED_ID),
            e(OTHER, 5, UNDEFINED_ID),
        ]);
        // a file created with 0666: no x anywhere
        let f = Acl::inherit(&d, libc::S_IFREG | 0o666, false);
        assert_eq!(f.mode, libc::S_IFREG | 0o664);
        let fa = f.access.unwrap();
        assert_eq!(fa.entries[0].perm, 6);
        assert_eq!(fa.entries[1].perm, 7, "named entries are not limited");
        assert_eq!(
            fa.entries[2].perm, 5,
            "group_obj is not limited when masked"
        );
        assert_eq!(fa.entries[3].perm, 6);
        assert_eq!(fa.entries[4].perm, 4);
        assert_eq!(fa.mode_bits(), 0o664);
        assert!(f.default.is_none());
        // a directory with 0777 (plus setgid, kept): everything, and the default too
        let dir = Acl::inherit(&d, 0o2777, true);
        assert_eq!(dir.mode, 0o2775);
        assert_eq!(dir.access.unwrap().mode_bits(), 0o775);
        assert_eq!(dir.default, Some(d.clone()));
        // a mode stricter than the ACL limits it
        let strict = Acl::inherit(&d, 0o600, false);
        assert_eq!(strict.mode, 0o600);
        assert_eq!(strict.access.unwrap().entries[3].perm, 0);
    }

    #[test]
    fn inheriting_a_base_only_default_sets_mode_but_no_access_acl() {
        let d = base(7, 5, 0);
        let f = Acl::inherit(&d, 0o666, false);
        assert_eq!(f.mode, 0o640);
        assert!(f.access.is_none());
        let dir = Acl::inherit(&d, 0o777, true);
        assert_eq!(dir.mode, 0o750);
        assert!(dir.access.is_none());
        assert_eq!(dir.default, Some(d));
    }
}
