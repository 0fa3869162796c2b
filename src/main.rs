//! The `railyard` command line: `railyard topology` today, `serve` and `bench` later.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let command = cli::Cli::parse();
    match command.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line: the error and its causes, never a backtrace.
            eprintln!("railyard: error: {error:#}");
            ExitCode::from(2)
        }
    }
}
