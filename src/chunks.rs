//! Chunk model: visible intervals, manifests, truncation.
