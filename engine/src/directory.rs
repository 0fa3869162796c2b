//! Where an engine finds its peers ([`DirectoryChoice`]), and the directory it runs for that:
//! p2p (peers by address; nothing to run) or etcd (feature `etcd`: this engine published
//! under its name with a lease, peers opened by name, their restarts and deaths reported to
//! the control plane by the watch).

use std::sync::{Mutex, PoisonError};

use railyard_control::{ControlPlane, SegmentDescriptor};

#[cfg(feature = "etcd")]
use railyard_control::etcd::{EtcdConfig, EtcdDirectory};

use super::error::{BuildError, PeerError};

/// Where an engine finds its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DirectoryChoice {
    /// By address only: each peer's own handshake listener describes it (the default).
    P2p,
    /// An etcd cluster (`etcd://HOST:PORT[,HOST:PORT...]`, or `etcd+tls://…?ca=FILE`, with
    /// `credentials=FILE` for an etcd that authenticates; see
    /// `railyard_control::etcd::EtcdConfig::from_url`): this engine publishes itself
    /// under its name with a lease, peers are opened by name, and a peer that restarts or
    /// dies is seen through etcd's watch (needs the cargo feature `etcd`).
    Etcd(String),
}

/// The running directory (or none).
#[derive(Debug)]
pub(crate) struct Directory {
    #[cfg(feature = "etcd")]
    etcd: Mutex<Option<EtcdDirectory>>,
    #[cfg(not(feature = "etcd"))]
    etcd: Mutex<Option<std::convert::Infallible>>,
    /// Publish no regions (with a cluster secret: peers get them from the authenticated
    /// handshake, not from whoever can read the directory).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    withhold_regions: bool,
}

/// `descriptor` as the directory publishes it: without its regions (their addresses and
/// keys) when `withhold_regions`.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
fn published(mut descriptor: SegmentDescriptor, withhold_regions: bool) -> SegmentDescriptor {
    if withhold_regions {
        descriptor.regions.clear();
    }
    descriptor
}

/// Starts what `choice` asks for, publishing `control`'s descriptor.
pub(crate) fn start(
    choice: &DirectoryChoice,
    control: &ControlPlane,
    withhold_regions: bool,
) -> Result<Directory, BuildError> {
    let url = match choice {
        DirectoryChoice::P2p => {
            return Ok(Directory {
                etcd: Mutex::new(None),
                withhold_regions,
            });
        }
        DirectoryChoice::Etcd(url) => url,
    };
    let advertised = control.local_addr();
    if advertised.ip().is_unspecified() {
        return Err(BuildError::Directory(format!(
            "the address {advertised} cannot be published in a directory: advertise the \
             address peers reach this host at"
        )));
    }
    #[cfg(feature = "etcd")]
    {
        let config = EtcdConfig::from_url(url).map_err(|e| BuildError::Directory(e.to_string()))?;
        let own = published(control.descriptor(), withhold_regions);
        let etcd = EtcdDirectory::start(config, own, control.peer_events())
            .map_err(|e| BuildError::Directory(e.to_string()))?;
        Ok(Directory {
            etcd: Mutex::new(Some(etcd)),
            withhold_regions,
        })
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = control;
        Err(BuildError::Directory(format!(
            "{url}: this railyard was built without etcd support (cargo feature `etcd`)"
        )))
    }
}

impl Directory {
    /// Leaves the directory (etcd: revokes the lease, so the key goes at once).
    pub(crate) fn stop(&self) {
        let _ = self
            .etcd
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    /// Publishes this engine's descriptor again (its regions changed).
    #[cfg_attr(not(feature = "etcd"), allow(clippy::unused_self))]
    pub(crate) fn publish(&self, descriptor: impl FnOnce() -> SegmentDescriptor) {
        #[cfg(feature = "etcd")]
        if let Some(etcd) = self
            .etcd
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            etcd.publish(published(descriptor(), self.withhold_regions));
        }
        #[cfg(not(feature = "etcd"))]
        let _ = descriptor;
    }

    /// The descriptor the segment named `name` published.
    pub(crate) fn resolve(&self, name: &str) -> Result<SegmentDescriptor, PeerError> {
        let unknown = |reason: String| PeerError::UnknownName {
            name: name.to_string(),
            reason,
        };
        let etcd = self.etcd.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(etcd) = etcd.as_ref() else {
            return Err(unknown(
                "it is not HOST:PORT, and names need a directory (--directory etcd://…)".into(),
            ));
        };
        #[cfg(feature = "etcd")]
        {
            etcd.resolve(name)
                .map(|record| record.descriptor)
                .ok_or_else(|| {
                    unknown(format!(
                        "no live segment has that name in etcd at {}",
                        etcd.endpoints()
                    ))
                })
        }
        #[cfg(not(feature = "etcd"))]
        match *etcd {}
    }
}
