//! The `railyard` command line: `railyard topology`, `railyard chaos`; `serve` and `bench`
//! come with the Engine API.

mod cli;

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    // Before any thread starts: it writes the environment libfabric reads when it starts.
    railyard::dataplane::fabric::ofi::settle_parameters();
    let command = match cli::Cli::try_parse() {
        Ok(command) => command,
        Err(error) if !error.use_stderr() => error.exit(), // --help, --version
        Err(error) => {
            // One line, like every other error: clap's lines up to its first blank one (a
            // conflict names the other flags on the lines after the first), without its
            // prefix.
            let text = error.to_string();
            let said: Vec<&str> = text
                .lines()
                .take_while(|line| !line.trim().is_empty())
                .map(str::trim)
                .collect();
            eprintln!(
                "railyard: error: {}",
                said.join(" ").trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
    };
    if let Err(error) = command.install_logging() {
        eprintln!("railyard: error: {error:#}");
        return ExitCode::from(2);
    }
    match command.run() {
        Ok(code) => code,
        Err(error) => {
            // One line: the error and its causes, never a backtrace.
            eprintln!("railyard: error: {error:#}");
            ExitCode::from(2)
        }
    }
}
