//! `railyard bench`: the main job. KV-cache-shaped transfers to a target — one shape, or a
//! sweep of block sizes × batch sizes drawn as an SVG — or round trips (`--latency`), each
//! measured beside the ceiling of this machine in the same run.

mod args;
mod ceiling;
mod latency;
mod memcpy_ceiling;
mod plot;
mod report;
mod run;
mod shapes;
mod target;
mod tcp_ceiling;
mod worker;

pub(crate) use args::BenchArgs;
pub(crate) use run::run;
