//! The `engram` service and CLI.
//!
//! # Layout
//! - [`cli`]: flag definitions and dispatch; each subcommand lives in [`commands`].
//! - [`config`]: the layered configuration of the binary (defaults, TOML, `ENGRAM_*`,
//!   flags). It lives here, not in a shared crate, because it names every service.
//! - [`up`]: `engram up`, which runs every service in one process around a managed (or
//!   given) nats-server. `run` takes its shutdown as a future, so tests pass their own.
//! - [`http`]: `/healthz` and `/metrics`.
//! - [`demo`]: the short walk-through `engram up --demo` prints for a new user.
//! - [`output`]: how events and receipts are printed, as text or JSON lines.

pub mod cli;
pub mod commands;
pub mod config;
pub mod demo;
pub mod http;
pub mod node;
pub mod nodes;
pub mod output;
pub mod up;
