//! Errors of topology discovery, planning and binding.

use std::path::PathBuf;

/// What went wrong while discovering, planning or binding.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The XML snapshot could not be read.
    #[error("cannot read topology XML {path}")]
    XmlRead {
        /// The file named by the caller.
        path: PathBuf,
        /// Why the OS refused.
        #[source]
        source: std::io::Error,
    },
    /// hwloc rejected the XML snapshot.
    #[error("{path} is not a valid hwloc XML topology ({reason})")]
    XmlInvalid {
        /// The file named by the caller.
        path: PathBuf,
        /// hwloc's diagnosis.
        reason: String,
    },
    /// hwloc failed while discovering or exporting the topology.
    #[error("hwloc failed to {operation}: {reason}")]
    Hwloc {
        /// What was being done.
        operation: &'static str,
        /// hwloc's diagnosis.
        reason: String,
    },
    /// The topology could not be written as XML.
    #[error("cannot write topology XML to {path}")]
    Export {
        /// The destination.
        path: PathBuf,
        /// Why the OS refused.
        #[source]
        source: std::io::Error,
    },
    /// A NIC list (`--nics`, `RAILYARD_NICS`) names a device that does not exist.
    #[error("--nics names {name}, but this machine has no such RDMA device (it has: {known})")]
    UnknownNic {
        /// The name in the list.
        name: String,
        /// The RDMA devices that do exist, comma-separated, or "none".
        known: String,
    },
    /// A NIC list entry is malformed.
    #[error("malformed --nics entry {entry:?}: {reason}")]
    InvalidNicList {
        /// The offending entry.
        entry: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A PU index that is not part of the topology.
    #[error("PU {pu} does not exist on this machine")]
    UnknownPu {
        /// The PU OS index asked for.
        pu: u32,
    },
    /// A NUMA node index that is not part of the topology.
    #[error("NUMA node {node} does not exist on this machine")]
    UnknownNumaNode {
        /// The NUMA node OS index asked for.
        node: u32,
    },
    /// The OS refused to pin the calling thread.
    #[error("cannot pin the calling thread to PU {pu}: {reason}")]
    PinThread {
        /// The PU OS index asked for.
        pu: u32,
        /// The OS's answer.
        reason: String,
    },
    /// The OS refused to bind memory to a NUMA node.
    #[error("cannot bind {len} bytes at {addr:#x} to NUMA node {node}: {reason}")]
    BindMemory {
        /// Start of the area.
        addr: usize,
        /// Length of the area.
        len: usize,
        /// The NUMA node OS index asked for.
        node: u32,
        /// The OS's answer.
        reason: String,
    },
}
