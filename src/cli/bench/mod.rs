//! `railyard bench`: the main job. KV-cache-shaped transfers to a target, measured beside
//! the memcpy ceiling of this machine.

mod args;
mod ceiling;
mod memcpy_ceiling;
mod report;
mod run;
mod target;
mod tcp_ceiling;
mod worker;

pub(crate) use args::BenchArgs;
pub(crate) use run::run;
