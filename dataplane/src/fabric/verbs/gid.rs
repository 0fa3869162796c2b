//! GID selection. On RoCE v2 the queue pair's source GID must be the IPv4-mapped GID of the
//! port's network device (routable, and what `ib_write_bw -x` picks); on InfiniBand index 0
//! is the port GID. The kernel lists a port's GID table in sysfs:
//! `ports/<p>/gids/<i>`, `ports/<p>/gid_attrs/types/<i>` and `…/ndevs/<i>`.

use std::path::Path;

/// What the kernel says a GID entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidKind {
    /// `IB/RoCE v1`.
    IbOrRoceV1,
    /// `RoCE v2`.
    RoceV2,
    /// Anything else (or no type file).
    Other,
}

/// One entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index (what `sgid_index` names).
    pub index: u8,
    /// The GID.
    pub gid: [u8; 16],
    /// Its type.
    pub kind: GidKind,
    /// The network device it belongs to (RoCE).
    pub netdev: Option<String>,
}

impl GidEntry {
    /// Whether it is an IPv4-mapped address (`::ffff:a.b.c.d`).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid[..10].iter().all(|&b| b == 0) && self.gid[10] == 0xff && self.gid[11] == 0xff
    }

    fn is_zero(&self) -> bool {
        self.gid.iter().all(|&b| b == 0)
    }
}

/// Parses `fe80:0000:…` (eight groups of four hex digits).
pub fn parse_gid(text: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = text.trim().split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    let mut gid = [0u8; 16];
    for (i, group) in groups.iter().enumerate() {
        let value = u16::from_str_radix(group, 16).ok()?;
        gid[2 * i..2 * i + 2].copy_from_slice(&value.to_be_bytes());
    }
    Some(gid)
}

/// Reads the GID table of one port directory (`/sys/class/infiniband/<dev>/ports/<p>`).
/// Unreadable or unused (all-zero) entries are left out.
pub fn read_gid_table(port_dir: &Path) -> Vec<GidEntry> {
    let Ok(entries) = std::fs::read_dir(port_dir.join("gids")) else {
        return Vec::new();
    };
    let mut table: Vec<GidEntry> = entries
        .flatten()
        .filter_map(|entry| {
            let index: u8 = entry.file_name().to_str()?.parse().ok()?;
            let gid = parse_gid(&std::fs::read_to_string(entry.path()).ok()?)?;
            let attr = |kind: &str| {
                std::fs::read_to_string(
                    port_dir
                        .join("gid_attrs")
                        .join(kind)
                        .join(index.to_string()),
                )
                .ok()
                .map(|s| s.trim().to_string())
            };
            let kind = match attr("types").as_deref() {
                Some("RoCE v2") => GidKind::RoceV2,
                Some("IB/RoCE v1") => GidKind::IbOrRoceV1,
                _ => GidKind::Other,
            };
            Some(GidEntry {
                index,
                gid,
                kind,
                netdev: attr("ndevs").filter(|n| !n.is_empty()),
            })
        })
        .filter(|entry| !entry.is_zero())
        .collect();
    table.sort_by_key(|entry| entry.index);
    table
}

/// The GID index to use: the first RoCE v2 IPv4-mapped entry, else the first RoCE v2 entry,
/// else the first entry (InfiniBand's port GID). `None` for an empty table.
pub fn choose_gid(table: &[GidEntry]) -> Option<u8> {
    let roce_v2 = |e: &&GidEntry| e.kind == GidKind::RoceV2;
    table
        .iter()
        .filter(roce_v2)
        .find(|e| e.is_ipv4_mapped())
        .or_else(|| table.iter().find(roce_v2))
        .or_else(|| table.first())
        .map(|e| e.index)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Writes a port directory the way the kernel lays it out.
    fn port(entries: &[(u8, &str, &str, &str)]) -> std::path::PathBuf {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("railyard-gid-{}-{n}", std::process::id()));
        for sub in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
            std::fs::create_dir_all(dir.join(sub)).expect("temp dir");
        }
        for (index, gid, kind, ndev) in entries {
            let write = |sub: &str, text: &str| {
                std::fs::write(dir.join(sub).join(index.to_string()), format!("{text}\n"))
                    .expect("write");
            };
            write("gids", gid);
            write("gid_attrs/types", kind);
            write("gid_attrs/ndevs", ndev);
        }
        dir
    }

    const ZERO: &str = "0000:0000:0000:0000:0000:0000:0000:0000";
    const LINK_LOCAL: &str = "fe80:0000:0000:0000:0202:c9ff:fe00:0001";
    const V4: &str = "0000:0000:0000:0000:0000:ffff:c0a8:0a02";

    #[test]
    fn roce_v2_prefers_the_ipv4_mapped_gid() {
        let dir = port(&[
            (0, LINK_LOCAL, "IB/RoCE v1", "eth0"),
            (1, LINK_LOCAL, "RoCE v2", "eth0"),
            (2, V4, "IB/RoCE v1", "eth0"),
            (3, V4, "RoCE v2", "eth0"),
            (4, ZERO, "", ""),
        ]);
        let table = read_gid_table(&dir);
        assert_eq!(table.len(), 4, "the zero entry is unused");
        assert_eq!(choose_gid(&table), Some(3));
        assert_eq!(table[3].netdev.as_deref(), Some("eth0"));
        assert!(table[3].is_ipv4_mapped() && !table[1].is_ipv4_mapped());
    }

    #[test]
    fn without_ipv4_the_first_roce_v2_and_on_infiniband_index_0() {
        let dir = port(&[
            (0, LINK_LOCAL, "IB/RoCE v1", "eth0"),
            (1, LINK_LOCAL, "RoCE v2", "eth0"),
        ]);
        assert_eq!(choose_gid(&read_gid_table(&dir)), Some(1));
        let ib = port(&[(0, LINK_LOCAL, "IB/RoCE v1", "")]);
        let table = read_gid_table(&ib);
        assert_eq!(choose_gid(&table), Some(0));
        assert_eq!(table[0].netdev, None);
        assert_eq!(choose_gid(&read_gid_table(Path::new("/nonexistent"))), None);
    }

    #[test]
    fn gids_parse_strictly() {
        let gid = parse_gid(V4).expect("valid");
        assert_eq!(&gid[10..], &[0xff, 0xff, 192, 168, 10, 2]);
        assert_eq!(parse_gid("fe80::1"), None);
        assert_eq!(parse_gid("zzzz:0:0:0:0:0:0:0"), None);
    }
}
