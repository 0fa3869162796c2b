//! `railyard secret new FILE`: a fresh cluster secret — 32 bytes from the kernel's random
//! source, written as 64 hexadecimal characters and a newline — in a file only its owner may
//! read (mode 0600), never over an existing file.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, Subcommand};

#[derive(Debug, Args)]
pub(crate) struct SecretArgs {
    #[command(subcommand)]
    action: SecretAction,
}

#[derive(Debug, Subcommand)]
enum SecretAction {
    /// Write a new secret into FILE: 32 random bytes from the kernel, as 64 hexadecimal
    /// characters and a newline (created with mode 0600; an existing file is refused). Give
    /// every process of the cluster the same file: `--secret-file FILE`, or
    /// `RAILYARD_SECRET_FILE=FILE`.
    New {
        /// Where to write it.
        file: PathBuf,
    },
}

/// Bytes of randomness in a new secret.
const SECRET_BYTES: usize = 32;

pub(crate) fn run(args: &SecretArgs) -> anyhow::Result<()> {
    match &args.action {
        SecretAction::New { file } => {
            let mut bytes = Vec::with_capacity(SECRET_BYTES);
            while bytes.len() < SECRET_BYTES {
                bytes.extend_from_slice(&random_u64_strict()?.to_le_bytes());
            }
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            let mut out = match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(file)
            {
                Ok(out) => out,
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                    anyhow::bail!(
                        "{} already exists: an existing secret is never overwritten (remove it \
                         first if it is to be replaced)",
                        file.display()
                    )
                }
                Err(error) => {
                    return Err(error).with_context(|| format!("creating {}", file.display()));
                }
            };
            if let Err(error) = writeln!(out, "{hex}").and_then(|()| out.sync_all()) {
                // A half-written secret must not stay behind to be taken for a whole one.
                drop(out);
                let _ = std::fs::remove_file(file);
                return Err(error).with_context(|| format!("writing {}", file.display()));
            }
            eprintln!(
                "railyard secret: wrote a new {SECRET_BYTES}-byte secret to {} (mode 0600); \
                 start every process with --secret-file {0} or RAILYARD_SECRET_FILE={0}",
                file.display()
            );
            Ok(())
        }
    }
}

/// 64 bits from the kernel's random source, or an error: a secret never falls back to
/// anything guessable.
fn random_u64_strict() -> anyhow::Result<u64> {
    let mut bytes = [0u8; 8];
    // SAFETY: `bytes` is writable for its length; getrandom writes at most that many bytes.
    let filled = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if filled != bytes.len() as isize {
        anyhow::bail!(
            "the kernel's random source failed: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(u64::from_le_bytes(bytes))
}
