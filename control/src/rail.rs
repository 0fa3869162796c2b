//! What the control plane needs from a rail's fabric to connect queue pairs — create one,
//! connect it to the peer's side, hand it to the poller — and the answers of the soft,
//! host (soft or TCP per peer) and verbs rails.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use railyard_dataplane::fabric::ofi::{OfiPeer, OfiRail};
use railyard_dataplane::fabric::soft::{SoftAttachment, SoftDevice, SoftQp};
use railyard_dataplane::fabric::tcp::{
    TcpAttachment, TcpDevice, TcpPreparedQp, TcpQp, TcpTarget, is_unspecified,
};
use railyard_dataplane::fabric::verbs::VerbsRail;
use railyard_dataplane::fabric::verbs::ffi::{PreparedQp, QueuePair};
use railyard_dataplane::fabric::{Access, QpInfo};
use railyard_dataplane::{EndpointId, Epoch};

use crate::descriptor::{RailDescriptor, SegmentDescriptor, fabric};
use crate::wire::QpSide;

/// What the control thread knows of the peer a queue pair is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLink {
    /// The peer runs on this host, in this PID namespace (from its Hello).
    pub same_host: bool,
    /// The local address the peer's control connection reached (where a target's fabric
    /// port is advertised when it listens on every address).
    pub local_ip: IpAddr,
}

/// A rail's fabric, as the control thread drives it. Never touches a queue pair the poller
/// already owns: `stage` hands it over and that is the end of the control plane's part.
/// Set-up is a typestate: a created queue pair ([`Self::Qp`]) becomes a connected one
/// ([`Self::Connected`]).
pub trait RailFabric: Send + Sync + 'static {
    /// A queue pair in INIT.
    type Qp: Send + 'static;
    /// A queue pair in RTS, not yet handed over.
    type Connected: Send + 'static;

    /// A new queue pair in INIT to initiate towards the peer of `link`, and what the peer
    /// needs to connect to it.
    ///
    /// # Errors
    /// Why the fabric could not make one (or cannot reach that peer).
    fn create_qp(&self, link: &PeerLink) -> Result<(Self::Qp, QpSide), String>;

    /// A new queue pair in INIT for the target's side of a connection that the peer of
    /// `link` initiates with `initiator`, ready to take WRITE_WITH_IMM immediates once
    /// connected ([`Self::take_immediates`]).
    ///
    /// # Errors
    /// Why the fabric could not make one.
    fn create_target_qp(
        &self,
        link: &PeerLink,
        initiator: &QpSide,
    ) -> Result<(Self::Qp, QpSide), String>;

    /// Appends the immediates that arrived on a target's connected queue pair since the
    /// last call to `out`, oldest first, and re-arms its receives.
    ///
    /// # Errors
    /// Why it cannot take any (the queue pair is in error).
    fn take_immediates(&self, qp: &mut Self::Connected, out: &mut Vec<u32>) -> Result<(), String>;

    /// Connects `qp` (INIT → RTR → RTS) to the peer's `remote` side.
    ///
    /// # Errors
    /// Why it could not connect (malformed side, unreachable peer).
    fn connect_qp(&self, qp: Self::Qp, remote: &QpSide) -> Result<Self::Connected, String>;

    /// Hands a connected queue pair to the rail's poller: its next connect for `endpoint` at
    /// `epoch` adopts it.
    ///
    /// # Errors
    /// When the fabric refuses it.
    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: Self::Connected) -> Result<(), String>;

    /// Takes a target's connected queue pair out of service: its peer's requests on it stop
    /// executing, and what is buffered from it is discarded. The returned
    /// [`Revocation`] says when that is done.
    fn revoke(&self, qp: Self::Connected) -> Revocation;

    /// How the rail appears in this process's segment descriptor.
    fn describe(&self) -> RailDescriptor;

    /// A peer's descriptor arrived (on first contact and after every refresh). Fabrics that
    /// check or translate remote addresses themselves learn the peer's regions here; the
    /// others keep the default.
    fn learn_descriptor(&self, _descriptor: &SegmentDescriptor) {}

    /// The peer of `descriptor` is forgotten (gone, or nothing refers to it any more): what
    /// [`Self::learn_descriptor`] kept of it goes.
    fn forget_descriptor(&self, _descriptor: &SegmentDescriptor) {}
}

/// A target queue pair taken out of service ([`RailFabric::revoke`]), to wait on.
pub struct Revocation(Box<dyn Fn(Instant) -> bool + Send>);

impl Revocation {
    /// Done at once (the fabric stopped the queue pair synchronously).
    pub(crate) fn done() -> Self {
        Self(Box::new(|_| true))
    }

    /// Waits until nothing of the queue pair can read or write this process's memory any
    /// more; false if `deadline` passes first (a stopped poller or peer).
    pub fn wait(&self, deadline: Instant) -> bool {
        (self.0)(deadline)
    }
}

impl std::fmt::Debug for Revocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Revocation")
    }
}

/// Drops a soft queue pair, which revokes it for its peer, and waits for the peer to leave
/// any copy it began before.
fn revoke_soft(device: &SoftDevice, qp: SoftQp) -> Revocation {
    drop(qp);
    let device = device.clone();
    Revocation(Box::new(move |deadline| device.quiesce_peers(deadline)))
}

const NOT_SAME_HOST: &str = "the soft fabric reaches only processes on this host (same boot \
     id and PID namespace), and this peer is not one (use --fabric tcp or auto)";

/// A soft queue pair in INIT and its side.
fn soft_qp(device: &SoftDevice) -> Result<(SoftQp, QpSide), String> {
    // Access is governed per registration; the queue pair itself allows everything.
    let mut qp = device.create_qp(Access::ALL).map_err(|e| e.to_string())?;
    qp.modify_to_init().map_err(|e| e.to_string())?;
    let side = QpSide {
        info: qp.info(),
        attachment: qp.attachment().encode().to_vec(),
    };
    Ok((qp, side))
}

/// Connects a soft queue pair to the peer's `remote` side.
fn connect_soft(mut qp: SoftQp, remote: &QpSide) -> Result<SoftQp, String> {
    let attachment = SoftAttachment::decode(&remote.attachment)?;
    qp.connect(&remote.info, &attachment)
        .map_err(|e| e.to_string())?;
    Ok(qp)
}

impl RailFabric for SoftDevice {
    type Qp = SoftQp;
    type Connected = SoftQp;

    fn create_qp(&self, link: &PeerLink) -> Result<(SoftQp, QpSide), String> {
        if !link.same_host {
            return Err(NOT_SAME_HOST.into());
        }
        soft_qp(self)
    }

    fn create_target_qp(
        &self,
        _link: &PeerLink,
        _initiator: &QpSide,
    ) -> Result<(SoftQp, QpSide), String> {
        // Every soft queue pair has its inbox.
        soft_qp(self)
    }

    fn take_immediates(&self, qp: &mut SoftQp, out: &mut Vec<u32>) -> Result<(), String> {
        qp.take_immediates(out);
        Ok(())
    }

    fn connect_qp(&self, qp: SoftQp, remote: &QpSide) -> Result<SoftQp, String> {
        connect_soft(qp, remote)
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: SoftQp) -> Result<(), String> {
        SoftDevice::stage(self, endpoint, epoch, qp).map_err(|e| e.to_string())
    }

    fn revoke(&self, qp: SoftQp) -> Revocation {
        revoke_soft(self, qp)
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: self.name().to_string(),
            fabric: fabric::SOFT,
            tcp_port: 0,
            address: Vec::new(),
        }
    }
}

/// Which fabric a host rail initiates with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostMode {
    /// The soft fabric for a peer on this host, TCP for one on another.
    Auto,
    /// The soft fabric only (peers on this host).
    Soft,
    /// TCP for every peer, even on this host.
    Tcp,
}

/// A rail of a host without RDMA: its soft device and the TCP device serving the same
/// registrations. It initiates per [`HostMode`]; as a target it answers with the fabric
/// the initiator chose.
#[derive(Clone, Debug)]
pub struct HostRail {
    /// The soft device (the registrations live in its table).
    pub soft: SoftDevice,
    /// The TCP device serving the same registrations.
    pub tcp: TcpDevice,
    /// How it initiates.
    pub mode: HostMode,
}

/// A host rail's queue pair in INIT.
#[derive(Debug)]
pub enum HostQp {
    /// On the soft fabric.
    Soft(SoftQp),
    /// A TCP initiator, to dial once the target answers.
    Tcp(TcpPreparedQp),
    /// A TCP target, waiting for its initiator's connection.
    TcpTarget(TcpTarget),
}

/// A host rail's connected queue pair.
#[derive(Debug)]
pub enum HostConnected {
    /// On the soft fabric.
    Soft(SoftQp),
    /// A TCP initiator's connection, for the poller.
    Tcp(TcpQp),
    /// A TCP target the rail's poller serves; the control thread keeps this handle.
    TcpTarget(TcpTarget),
}

impl HostRail {
    fn uses_tcp(&self, link: &PeerLink) -> bool {
        match self.mode {
            HostMode::Auto => !link.same_host,
            HostMode::Soft => false,
            HostMode::Tcp => true,
        }
    }
}

impl RailFabric for HostRail {
    type Qp = HostQp;
    type Connected = HostConnected;

    fn create_qp(&self, link: &PeerLink) -> Result<(HostQp, QpSide), String> {
        if self.uses_tcp(link) {
            let (qp, info) = self.tcp.create_qp();
            let attachment = TcpAttachment::Initiator.encode();
            return Ok((HostQp::Tcp(qp), QpSide { info, attachment }));
        }
        let (qp, side) = RailFabric::create_qp(&self.soft, link)?;
        Ok((HostQp::Soft(qp), side))
    }

    fn create_target_qp(
        &self,
        link: &PeerLink,
        initiator: &QpSide,
    ) -> Result<(HostQp, QpSide), String> {
        if !TcpAttachment::is_tcp(&initiator.attachment) {
            let (qp, side) = soft_qp(&self.soft)?;
            return Ok((HostQp::Soft(qp), side));
        }
        let bound = self.tcp.local_addr().ip();
        let advertise = if is_unspecified(bound) {
            link.local_ip
        } else {
            bound
        };
        let (target, info, attachment) = self.tcp.create_target(advertise);
        let side = QpSide {
            info,
            attachment: attachment.encode(),
        };
        Ok((HostQp::TcpTarget(target), side))
    }

    fn take_immediates(&self, qp: &mut HostConnected, out: &mut Vec<u32>) -> Result<(), String> {
        match qp {
            HostConnected::Soft(qp) => qp.take_immediates(out),
            HostConnected::TcpTarget(target) => target.take_immediates(out),
            HostConnected::Tcp(_) => {}
        }
        Ok(())
    }

    fn connect_qp(&self, qp: HostQp, remote: &QpSide) -> Result<HostConnected, String> {
        match qp {
            HostQp::Soft(qp) => connect_soft(qp, remote).map(HostConnected::Soft),
            HostQp::Tcp(prepared) => {
                let attachment =
                    TcpAttachment::decode(&remote.attachment).map_err(|e| e.to_string())?;
                self.tcp
                    .connect(prepared, &attachment)
                    .map(HostConnected::Tcp)
                    .map_err(|e| e.to_string())
            }
            // The initiator dials; the poller serves the connection once it says hello.
            HostQp::TcpTarget(target) => Ok(HostConnected::TcpTarget(target)),
        }
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: HostConnected) -> Result<(), String> {
        match qp {
            HostConnected::Soft(qp) => {
                SoftDevice::stage(&self.soft, endpoint, epoch, qp).map_err(|e| e.to_string())
            }
            HostConnected::Tcp(qp) => {
                self.tcp.stage(endpoint, epoch, qp);
                Ok(())
            }
            HostConnected::TcpTarget(_) => {
                Err("a target's queue pair is served, never staged for an endpoint".into())
            }
        }
    }

    fn revoke(&self, qp: HostConnected) -> Revocation {
        match qp {
            HostConnected::Soft(qp) => revoke_soft(&self.soft, qp),
            HostConnected::TcpTarget(target) => {
                let closed = target.close();
                Revocation(Box::new(move |deadline| closed.wait(deadline)))
            }
            // An initiator's connection: closing it is all there is.
            HostConnected::Tcp(qp) => {
                drop(qp);
                Revocation::done()
            }
        }
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: self.soft.name().to_string(),
            fabric: match self.mode {
                HostMode::Tcp => fabric::TCP,
                HostMode::Auto | HostMode::Soft => fabric::SOFT,
            },
            tcp_port: self.tcp.local_addr().port(),
            address: Vec::new(),
        }
    }
}

impl RailFabric for Arc<VerbsRail> {
    type Qp = PreparedQp;
    type Connected = QueuePair;

    fn create_qp(&self, _link: &PeerLink) -> Result<(PreparedQp, QpSide), String> {
        // A random first PSN per queue pair, as verbs expects.
        let psn = railyard_dataplane::entropy::random_u64() as u32;
        let (qp, info) = VerbsRail::create_qp(self, psn).map_err(|e| e.to_string())?;
        Ok((qp, verbs_side(info)))
    }

    fn create_target_qp(
        &self,
        _link: &PeerLink,
        _initiator: &QpSide,
    ) -> Result<(PreparedQp, QpSide), String> {
        let psn = railyard_dataplane::entropy::random_u64() as u32;
        let (qp, info) = VerbsRail::create_target_qp(self, psn).map_err(|e| e.to_string())?;
        Ok((qp, verbs_side(info)))
    }

    fn take_immediates(&self, qp: &mut QueuePair, out: &mut Vec<u32>) -> Result<(), String> {
        qp.take_immediates(out).map_err(|e| e.to_string())
    }

    fn connect_qp(&self, qp: PreparedQp, remote: &QpSide) -> Result<QueuePair, String> {
        self.connect(qp, &remote.info).map_err(|e| e.to_string())
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: QueuePair) -> Result<(), String> {
        VerbsRail::stage(self, endpoint, epoch, qp);
        Ok(())
    }

    /// Destroying the queue pair stops the NIC answering on it before `ibv_destroy_qp`
    /// returns.
    fn revoke(&self, qp: QueuePair) -> Revocation {
        drop(qp);
        Revocation::done()
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: self.name().to_string(),
            fabric: fabric::VERBS,
            tcp_port: 0,
            address: Vec::new(),
        }
    }
}

fn verbs_side(info: QpInfo) -> QpSide {
    QpSide {
        info,
        attachment: Vec::new(),
    }
}

/// One side of a libfabric "queue pair" before it is connected: nothing is allocated per
/// peer on a reliable-datagram endpoint, only the tag the target side gives the connection.
#[derive(Debug)]
pub enum OfiHalf {
    /// The initiator's side.
    Initiator,
    /// The target's side.
    Target(OfiTag),
}

/// A connected libfabric "queue pair".
#[derive(Debug)]
pub enum OfiConnected {
    /// The initiator's: the peer to stage for the poller.
    Initiator(OfiPeer),
    /// The target's: where its immediates are kept.
    Target(OfiTag),
}

/// A target's tag for one connection (the high 32 bits of the remote CQ data of the
/// initiator's immediates): open while this lives, closed when it drops — however the
/// control plane lets go of the queue pair.
#[derive(Debug)]
pub struct OfiTag {
    rail: Arc<OfiRail>,
    tag: u32,
}

impl OfiTag {
    /// Opens a fresh tag on `rail`: a random one not open for another connection.
    fn open(rail: &Arc<OfiRail>) -> Result<Self, String> {
        (0..64)
            .map(|_| railyard_dataplane::entropy::random_u64() as u32)
            .find(|&tag| rail.open_immediates(tag))
            .map(|tag| Self {
                rail: rail.clone(),
                tag,
            })
            .ok_or_else(|| "no free immediate tag after 64 draws".into())
    }
}

impl Drop for OfiTag {
    fn drop(&mut self) {
        self.rail.close_immediates(self.tag);
    }
}

/// The attachment of a libfabric side: the tag (little-endian) and the endpoint's address.
fn ofi_attachment(rail: &OfiRail, tag: u32) -> Vec<u8> {
    let mut attachment = tag.to_le_bytes().to_vec();
    attachment.extend_from_slice(rail.address());
    attachment
}

fn ofi_side(rail: &OfiRail, tag: u32) -> QpSide {
    QpSide {
        info: QpInfo {
            // Names the offer in RetireQp; libfabric has no queue-pair number.
            qp_num: (railyard_dataplane::entropy::random_u64() as u32 & 0x00ff_ffff).max(1),
            lid: 0,
            gid: [0; 16],
            psn: 0,
            path_mtu: 4096,
        },
        attachment: ofi_attachment(rail, tag),
    }
}

/// Reads a libfabric side's attachment.
fn ofi_peer(remote: &QpSide) -> Result<OfiPeer, String> {
    match remote.attachment.split_first_chunk::<4>() {
        Some((tag, address)) if !address.is_empty() => Ok(OfiPeer {
            address: address.to_vec(),
            tag: u32::from_le_bytes(*tag),
        }),
        _ => Err(format!(
            "a libfabric side needs a tag and an endpoint address: {} bytes of attachment",
            remote.attachment.len()
        )),
    }
}

impl RailFabric for Arc<OfiRail> {
    type Qp = OfiHalf;
    type Connected = OfiConnected;

    fn create_qp(&self, _link: &PeerLink) -> Result<(OfiHalf, QpSide), String> {
        Ok((OfiHalf::Initiator, ofi_side(self, 0)))
    }

    /// Opens the immediates of a fresh tag for the initiator's connection.
    fn create_target_qp(
        &self,
        _link: &PeerLink,
        initiator: &QpSide,
    ) -> Result<(OfiHalf, QpSide), String> {
        ofi_peer(initiator)?;
        let tag = OfiTag::open(self)?;
        let side = ofi_side(self, tag.tag);
        Ok((OfiHalf::Target(tag), side))
    }

    fn take_immediates(&self, qp: &mut OfiConnected, out: &mut Vec<u32>) -> Result<(), String> {
        if let OfiConnected::Target(tag) = qp {
            OfiRail::take_immediates(self, tag.tag, out);
        }
        Ok(())
    }

    fn connect_qp(&self, qp: OfiHalf, remote: &QpSide) -> Result<OfiConnected, String> {
        let peer = ofi_peer(remote)?;
        Ok(match qp {
            OfiHalf::Initiator => OfiConnected::Initiator(peer),
            OfiHalf::Target(tag) => OfiConnected::Target(tag),
        })
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: OfiConnected) -> Result<(), String> {
        match qp {
            OfiConnected::Initiator(peer) => {
                OfiRail::stage(self, endpoint, epoch, peer);
                Ok(())
            }
            OfiConnected::Target(_) => {
                Err("a target's queue pair is served, never staged for an endpoint".into())
            }
        }
    }

    /// A reliable-datagram endpoint keeps no state per initiator: the target side's
    /// immediates stop being kept (its tag closes); RMA by key lasts until the region is
    /// deregistered.
    fn revoke(&self, qp: OfiConnected) -> Revocation {
        // A target's tag closes as it drops.
        drop(qp);
        Revocation::done()
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: self.name().to_string(),
            fabric: fabric::OFI,
            tcp_port: 0,
            address: self.address().to_vec(),
        }
    }

    /// Forgets the regions of each of the peer's libfabric rails.
    fn forget_descriptor(&self, descriptor: &SegmentDescriptor) {
        for rail in &descriptor.rails {
            if rail.fabric == fabric::OFI {
                self.forget_remote_regions(&rail.address, descriptor.incarnation.0);
            }
        }
    }

    /// Learns the regions of each of the peer's libfabric rails, by that rail's address.
    fn learn_descriptor(&self, descriptor: &SegmentDescriptor) {
        for (index, rail) in descriptor.rails.iter().enumerate() {
            if rail.fabric != fabric::OFI || rail.address.is_empty() {
                continue;
            }
            self.learn_remote_regions(
                &rail.address,
                descriptor.incarnation.0,
                descriptor.regions.iter().filter_map(|region| {
                    let rkey = *region.rkeys.get(index)?;
                    Some((rkey, region.base, region.len, region.access))
                }),
            );
        }
    }
}

#[cfg(test)]
mod ofi_tests {
    use super::*;
    use railyard_dataplane::fabric::ofi::OfiConfig;

    #[test]
    fn a_target_side_tag_stays_open_while_its_queue_pair_lives_however_it_goes() {
        let rail = OfiRail::open(
            "tags",
            &OfiConfig {
                provider: "tcp;ofi_rxm".into(),
                domain: Some("lo".into()),
            },
        )
        .expect("libfabric's tcp;ofi_rxm provider on lo");
        let link = PeerLink {
            same_host: true,
            local_ip: IpAddr::from([127, 0, 0, 1]),
        };
        let (_, initiator) = rail.create_qp(&link).expect("an initiator's side");
        let tag_of = |side: &QpSide| ofi_peer(side).expect("a libfabric side").tag;

        // Dropped before connecting.
        let (half, side) = rail
            .create_target_qp(&link, &initiator)
            .expect("a target side");
        let tag = tag_of(&side);
        assert!(!rail.open_immediates(tag), "open while it lives");
        drop(half);
        assert!(rail.open_immediates(tag), "closed with it");
        rail.close_immediates(tag);

        // Connected, then dropped by the control plane, or revoked.
        for revoke in [false, true] {
            let (half, side) = rail
                .create_target_qp(&link, &initiator)
                .expect("a target side");
            let tag = tag_of(&side);
            let connected = rail.connect_qp(half, &initiator).expect("connected");
            assert!(!rail.open_immediates(tag));
            if revoke {
                assert!(rail.revoke(connected).wait(Instant::now()));
            } else {
                drop(connected);
            }
            assert!(rail.open_immediates(tag), "closed (revoked: {revoke})");
            rail.close_immediates(tag);
        }

        // A malformed initiator side is refused.
        let short = QpSide {
            info: initiator.info,
            attachment: vec![1, 2, 3],
        };
        assert!(rail.create_target_qp(&link, &short).is_err());
    }
}
