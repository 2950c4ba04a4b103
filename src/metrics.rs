//! Prometheus metrics.
