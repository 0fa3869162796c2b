//! `railyard secret new FILE`: a fresh secret only its owner may read, never written over
//! an existing one, and one the engine takes.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use common::output_within;

fn secret_new(path: &std::path::Path) -> std::process::Output {
    output_within(
        Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args(["secret", "new"])
            .arg(path),
        Duration::from_secs(30),
    )
}

#[test]
fn a_new_secret_is_random_private_and_never_overwritten() {
    let dir = std::env::temp_dir().join(format!("railyard-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let (first, second) = (dir.join("a"), dir.join("b"));
    for path in [&first, &second] {
        let _ = std::fs::remove_file(path);
        let made = secret_new(path);
        assert!(
            made.status.success(),
            "{}",
            String::from_utf8_lossy(&made.stderr)
        );
    }
    let text = std::fs::read_to_string(&first).expect("the secret");
    let hex = text.strip_suffix('\n').expect("one line");
    assert_eq!(hex.len(), 64, "32 bytes in hexadecimal: {text:?}");
    assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{text:?}");
    assert_ne!(
        text,
        std::fs::read_to_string(&second).expect("the other secret"),
        "two secrets are two"
    );
    let mode = std::fs::metadata(&first)
        .expect("metadata")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "mode {:o}", mode & 0o777);
    railyard::engine::ClusterSecret::from_file(&first).expect("the engine takes it");

    // An existing secret is kept, and the refusal says why.
    let again = secret_new(&first);
    assert!(!again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        stderr.contains("already exists") && stderr.contains("never overwritten"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&first).expect("kept"), text);
    // A directory that is not there is named as such, not as an existing secret.
    let nowhere = secret_new(&dir.join("missing").join("secret"));
    assert!(!nowhere.status.success());
    let stderr = String::from_utf8_lossy(&nowhere.stderr);
    assert!(
        stderr.contains("creating") && !stderr.contains("already exists"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn encrypt_control_needs_a_secret_and_bench_runs_with_it() {
    let serve = |flag: Option<&str>, env: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_railyard"));
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--pool", "1MiB"])
            .arg("--until-stdin-closes")
            .stdin(std::process::Stdio::null())
            .env_remove("RAILYARD_SECRET_FILE")
            .env_remove("RAILYARD_ENCRYPT_CONTROL");
        command.args(flag);
        if let Some(value) = env {
            command.env("RAILYARD_ENCRYPT_CONTROL", value);
        }
        output_within(&mut command, Duration::from_secs(30))
    };
    // Asked for by the flag or by the environment (as Python reads it), without a secret.
    for (flag, env) in [(Some("--encrypt-control"), None), (None, Some("1"))] {
        let alone = serve(flag, env);
        assert_eq!(alone.status.code(), Some(2), "{flag:?} {env:?}: {alone:?}");
        let stderr = String::from_utf8_lossy(&alone.stderr);
        assert!(
            stderr.contains("needs a cluster secret") && stderr.contains("--secret-file"),
            "{stderr}"
        );
    }
    // Not asked for: the environment saying no starts as without it.
    let off = serve(None, Some("0"));
    assert!(off.status.success(), "{off:?}");
    let no_secret = railyard::engine::Engine::builder("encrypting")
        .encrypt_control(true)
        .build()
        .expect_err("refused without a secret");
    assert!(
        no_secret.to_string().contains("needs a cluster secret"),
        "{no_secret}"
    );

    let path = std::env::temp_dir().join(format!("railyard-encrypt-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    assert!(secret_new(&path).status.success());
    // bench starts its own target (`serve`) and hands it the secret and the flag.
    let bench = output_within(
        Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args([
                "bench",
                "--fabric",
                "tcp",
                "--pool",
                "8MiB",
                "--block-size",
                "64KiB",
                "--batch",
                "4",
                "--duration",
                "0.3",
                "--check",
                "--json",
                "--encrypt-control",
            ])
            .arg("--secret-file")
            .arg(&path),
        Duration::from_secs(120),
    );
    let _ = std::fs::remove_file(&path);
    let stdout = String::from_utf8_lossy(&bench.stdout);
    assert!(
        bench.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    assert!(stdout.contains("\"gbps\""), "{stdout}");
}
