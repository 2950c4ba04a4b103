//! fd-keeper role: holds duplicates of live /dev/fuse fds across plugin restarts.
