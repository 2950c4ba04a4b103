//! Generated protobuf/gRPC code for our own wire-compatible protos.
#![allow(clippy::all, missing_docs)]

pub mod filer {
    tonic::include_proto!("filer_pb");
}
pub mod csi {
    tonic::include_proto!("csi.v1");
}
