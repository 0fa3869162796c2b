//! Argument parsing and dispatch for the `railyard` binary.

mod bench;
mod chaos;
mod command;
mod doctor;
mod duration;
mod engine_args;
mod handshakes;
mod master;
mod ping;
mod secret;
mod serve;
mod sim;
mod size;
mod store;
mod store_bench;
mod topology;

pub(crate) use command::Cli;
