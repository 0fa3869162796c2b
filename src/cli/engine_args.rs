//! The engine settings `serve` and `bench` share on their command lines: how `--fabric` and
//! `--directory` parse, the verbs and libfabric rail settings, and the cluster secret.

/// `--fabric auto|soft|tcp|verbs|ofi`.
pub(super) fn parse_fabric(text: &str) -> Result<railyard::engine::FabricChoice, String> {
    use railyard::engine::FabricChoice;
    match text {
        "auto" => Ok(FabricChoice::Auto),
        "soft" => Ok(FabricChoice::Soft),
        "tcp" => Ok(FabricChoice::Tcp),
        "verbs" => Ok(FabricChoice::Verbs),
        "ofi" => Ok(FabricChoice::Ofi),
        other => Err(format!(
            "{other:?} is not a fabric (auto, soft, tcp, verbs, ofi)"
        )),
    }
}

/// `--directory p2p|etcd[+tls]://HOST:PORT[,HOST:PORT...][?…]`.
pub(super) fn parse_directory(text: &str) -> Result<railyard::engine::DirectoryChoice, String> {
    use railyard::engine::DirectoryChoice;
    match text {
        "p2p" => Ok(DirectoryChoice::P2p),
        url if url.starts_with("etcd://") || url.starts_with("etcd+tls://") => {
            Ok(DirectoryChoice::Etcd(url.to_string()))
        }
        other => Err(format!(
            "{other:?} is not a directory (p2p, or etcd[+tls]://HOST:PORT[,HOST:PORT...])"
        )),
    }
}

/// The cluster secret of `serve` and `bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct SecretArgs {
    /// A file holding the cluster's secret (at least 16 bytes; a trailing newline is not
    /// part of it): peers must prove they hold the same before anything is answered, and
    /// this process proves it to them. Without one, peers are not authenticated (a warning
    /// says so once, unless the process listens on loopback only).
    #[arg(long, value_name = "PATH", env = "RAILYARD_SECRET_FILE")]
    pub(crate) secret_file: Option<std::path::PathBuf>,
}

impl SecretArgs {
    /// `builder` with the secret, if one was given.
    ///
    /// # Errors
    /// The file cannot be read, or holds too short a secret.
    pub(crate) fn apply(
        &self,
        builder: railyard::engine::EngineBuilder,
    ) -> anyhow::Result<railyard::engine::EngineBuilder> {
        Ok(match self.secret()? {
            Some(secret) => builder.secret(secret),
            None => builder,
        })
    }

    /// The secret, if a file was given.
    ///
    /// # Errors
    /// The file cannot be read, or holds too short a secret.
    pub(crate) fn secret(&self) -> anyhow::Result<Option<railyard::engine::ClusterSecret>> {
        Ok(self
            .secret_file
            .as_deref()
            .map(railyard::engine::ClusterSecret::from_file)
            .transpose()?)
    }

    /// The options that give a child process the same secret.
    pub(crate) fn options(&self) -> Vec<std::ffi::OsString> {
        self.secret_file
            .iter()
            .flat_map(|path| ["--secret-file".into(), path.clone().into_os_string()])
            .collect()
    }
}

/// An engine's cluster secret (`serve`, `bench`), and whether its control frames are
/// encrypted.
#[derive(Debug, clap::Args)]
pub(crate) struct EngineSecretArgs {
    #[command(flatten)]
    pub(crate) secret: SecretArgs,
    /// Encrypt control frames after the handshake (AES-256-GCM), so that no region
    /// address, key, data-port token or notification can be read in them on the path (the
    /// data path is not encrypted: a TCP data connection shows its token, each request its
    /// address and key); with a secret alone they are authenticated (HMAC-SHA256,
    /// sequence-numbered) but readable. Either side of a connection asking is enough. Needs
    /// --secret-file.
    #[arg(
        long,
        env = "RAILYARD_ENCRYPT_CONTROL",
        value_parser = clap::builder::BoolishValueParser::new(),
        num_args = 0..=1,
        default_missing_value = "true",
        require_equals = true
    )]
    pub(crate) encrypt_control: bool,
}

impl EngineSecretArgs {
    /// `builder` with the secret, if one was given, and the encryption asked for.
    ///
    /// # Errors
    /// The file cannot be read, or holds too short a secret.
    pub(crate) fn apply(
        &self,
        builder: railyard::engine::EngineBuilder,
    ) -> anyhow::Result<railyard::engine::EngineBuilder> {
        Ok(self
            .secret
            .apply(builder)?
            .encrypt_control(self.encrypt_control))
    }

    /// Whether a secret file was given.
    pub(crate) fn has_secret(&self) -> bool {
        self.secret.secret_file.is_some()
    }

    /// The options that give a child process the same secret and encryption.
    pub(crate) fn options(&self) -> Vec<std::ffi::OsString> {
        let mut options = self.secret.options();
        if self.encrypt_control {
            options.push("--encrypt-control".into());
        }
        options
    }
}

/// Verbs and libfabric rail settings shared by `serve` and `bench` (ignored on the soft
/// fabric).
#[derive(Debug, clap::Args)]
pub(crate) struct VerbsArgs {
    /// The libfabric provider of `--fabric ofi`, as `fi_info -l` names it (default: efa when
    /// this machine has it; a software provider such as "tcp;ofi_rxm" only when named).
    #[arg(long, value_name = "NAME")]
    pub(crate) ofi_provider: Option<String>,
    /// RDMA port of every rail (default: the first ACTIVE one).
    #[arg(long, value_name = "N")]
    pub(crate) ib_port: Option<u8>,
    /// GID index of every rail (default: RoCE v2 IPv4-mapped GID on Ethernet, none on IB).
    #[arg(long, value_name = "N")]
    pub(crate) gid_index: Option<u8>,
    /// Traffic class of RoCE v2 packets (DSCP << 2 | ECN; e.g. 106 for DSCP 26 on a lossless
    /// class).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) traffic_class: u8,
}

impl VerbsArgs {
    /// Refuses settings of another fabric than `fabric`.
    ///
    /// # Errors
    /// `--ofi-provider` without `--fabric ofi`.
    pub(crate) fn check(&self, fabric: railyard::engine::FabricChoice) -> anyhow::Result<()> {
        if self.ofi_provider.is_some() && fabric != railyard::engine::FabricChoice::Ofi {
            anyhow::bail!("--ofi-provider is for --fabric ofi");
        }
        Ok(())
    }

    /// `builder` with these settings.
    pub(crate) fn apply(
        &self,
        builder: railyard::engine::EngineBuilder,
    ) -> railyard::engine::EngineBuilder {
        let builder = builder.verbs(self.config());
        match &self.ofi_provider {
            Some(provider) => builder.ofi(provider),
            None => builder,
        }
    }

    fn config(&self) -> railyard::engine::RailConfig {
        let defaults = railyard::engine::RailConfig::default();
        railyard::engine::RailConfig {
            port: self.ib_port,
            gid_index: self.gid_index,
            qp: railyard::dataplane::fabric::verbs::attrs::QpConfig {
                traffic_class: self.traffic_class,
                ..defaults.qp
            },
            ..defaults
        }
    }
}

/// Where `--metrics` serves: `PORT` or `:PORT` is loopback (127.0.0.1), so that metrics
/// leave the host only when an address says so (`0.0.0.0:9100`).
pub(crate) fn parse_metrics_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    let port = text.strip_prefix(':').unwrap_or(text);
    if let Ok(port) = port.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    }
    text.parse().map_err(|_| {
        format!("{text:?} is neither a port (9100, :9100: loopback) nor an address (0.0.0.0:9100)")
    })
}

#[cfg(test)]
mod metrics_addr_tests {
    use super::*;

    #[test]
    fn a_bare_port_is_loopback_and_an_address_is_taken_as_given() {
        assert_eq!(
            parse_metrics_addr("9100").unwrap().to_string(),
            "127.0.0.1:9100"
        );
        assert_eq!(parse_metrics_addr(":0").unwrap().to_string(), "127.0.0.1:0");
        assert_eq!(
            parse_metrics_addr("0.0.0.0:9100").unwrap().to_string(),
            "0.0.0.0:9100"
        );
        assert!(parse_metrics_addr("nine").unwrap_err().contains("neither"));
    }
}
