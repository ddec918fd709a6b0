//! `engram bench`: quality benchmarks that run through the real system.

pub mod locomo;
pub mod query;
