//! The `railyard` command line: `railyard topology`, `railyard chaos`; `serve` and `bench`
//! come with the Engine API.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let command = cli::Cli::parse();
    match command.run() {
        Ok(code) => code,
        Err(error) => {
            // One line: the error and its causes, never a backtrace.
            eprintln!("railyard: error: {error:#}");
            ExitCode::from(2)
        }
    }
}
