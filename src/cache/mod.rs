//! Chunk cache and metadata cache.
