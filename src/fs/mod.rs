//! Filesystem logic, free of FUSE types.
