//! Which host a process runs on, as far as the soft fabric cares: the kernel it runs under
//! (boot id) and its PID namespace. Two processes with the same [`HostId`] can reach each
//! other's memory (`process_vm_writev`, pidfds); any other pair needs a network fabric.

use std::path::Path;

/// A host and PID namespace, exchanged in Hello.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostId {
    /// `/proc/sys/kernel/random/boot_id`, as 16 bytes (zeros when unreadable).
    pub boot_id: [u8; 16],
    /// The inode of `/proc/self/ns/pid` (0 when unreadable).
    pub pid_namespace: u64,
}

impl HostId {
    /// This process's.
    pub fn this_process() -> Self {
        Self {
            boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .ok()
                .and_then(|text| parse_boot_id(&text))
                .unwrap_or_default(),
            pid_namespace: namespace_inode(Path::new("/proc/self/ns/pid")).unwrap_or(0),
        }
    }

    /// Whether both are known (nothing unreadable) and equal: the same kernel and PID
    /// namespace.
    pub fn same_host_as(&self, other: &Self) -> bool {
        self.is_known() && self == other
    }

    fn is_known(&self) -> bool {
        self.boot_id != [0; 16] && self.pid_namespace != 0
    }
}

/// A boot id's 16 bytes from its text form (`8-4-4-4-12` hex digits).
fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let digits: Vec<u8> = text
        .trim()
        .bytes()
        .filter(|b| *b != b'-')
        .map(|b| (b as char).to_digit(16).map(|d| d as u8))
        .collect::<Option<_>>()?;
    if digits.len() != 32 {
        return None;
    }
    let mut id = [0; 16];
    for (byte, pair) in id.iter_mut().zip(digits.chunks(2)) {
        *byte = pair[0] << 4 | pair[1];
    }
    Some(id)
}

/// The inode a namespace link names (`pid:[4026531836]`).
fn namespace_inode(link: &Path) -> Option<u64> {
    let target = std::fs::read_link(link).ok()?;
    let text = target.to_str()?;
    text.split_once('[')?.1.strip_suffix(']')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_on_its_own_host_and_unknown_hosts_never_match() {
        let here = HostId::this_process();
        assert!(here.same_host_as(&here), "{here:?}");
        let elsewhere = HostId {
            pid_namespace: here.pid_namespace + 1,
            ..here
        };
        assert!(!here.same_host_as(&elsewhere));
        assert!(!HostId::default().same_host_as(&HostId::default()));
    }

    #[test]
    fn boot_ids_parse_from_their_text_form() {
        let id = parse_boot_id("0b1e5c2a-33f4-4c1d-9a8e-0123456789ab\n").unwrap();
        assert_eq!(id[0], 0x0b);
        assert_eq!(id[15], 0xab);
        assert_eq!(parse_boot_id("not-a-uuid"), None);
        assert_eq!(parse_boot_id("0b1e5c2a"), None);
    }
}
