//! The control plane's warnings: their kinds, a directory warning's fields, and the macro
//! that counts one and emits it as a `tracing` event. Each event has target
//! `railyard::control`, the engine's name and the warning's kind as fields, and the fields
//! of what it is about (`peer`, `addr`, `incarnation`, `endpoint`, `epoch`, `rail`,
//! `reason`) — no formatted sentences to parse.
//! Rate limiting is the subscriber's business: a reconnect storm is many events of one
//! kind, which `railyard::logging::RateLimit` folds into a count.

use std::fmt;

use crate::endpoint::Incarnation;

/// A warning about the cluster directory, as its fields.
#[derive(Clone, Debug)]
pub struct DirectoryWarning {
    /// What happened (the event's message).
    pub message: &'static str,
    /// The directory's endpoints (the `directory` field).
    pub directory: String,
    /// The name it concerns, if one (the `peer` field).
    pub peer: Option<String>,
    /// The incarnation it concerns, if one.
    pub incarnation: Option<Incarnation>,
    /// Why, or what else is known (the `reason` field).
    pub reason: Option<String>,
}

/// Kinds of repeatable warnings (the `kind` field of a control-plane warning event).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WarningKind {
    /// An endpoint reconnects.
    Reconnect,
    /// An endpoint or passive queue pair is retired.
    Retire,
    /// A handshake failed or was refused.
    Handshake,
    /// A circuit opened.
    Circuit,
    /// The cluster directory is unreachable or refused something.
    Directory,
    /// A connection was closed for breaking a bound or the protocol, or the listener paused.
    Connection,
    /// A peer did not prove the cluster secret.
    Auth,
}

impl WarningKind {
    /// Every kind, in the order of [`Self::index`].
    pub const ALL: [WarningKind; 7] = [
        Self::Reconnect,
        Self::Retire,
        Self::Handshake,
        Self::Circuit,
        Self::Directory,
        Self::Connection,
        Self::Auth,
    ];

    /// The value of the `kind` field (and of the `kind` label of the warnings metric).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reconnect => "reconnect",
            Self::Retire => "retire",
            Self::Handshake => "handshake",
            Self::Circuit => "circuit",
            Self::Directory => "directory",
            Self::Connection => "connection",
            Self::Auth => "auth",
        }
    }

    /// Its position in [`Self::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for WarningKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counts a warning of `$kind` in `$shared`'s counters and emits it as a `tracing` warning
/// with target `railyard::control` and the fields `engine` (`$engine`) and `kind`, then the
/// given fields and message, in `tracing::warn!` syntax.
macro_rules! control_warning {
    ($shared:expr, $engine:expr, $kind:expr, $($fields:tt)+) => {{
        let kind: $crate::warn::WarningKind = $kind;
        $shared.count_warning(kind);
        tracing::warn!(
            target: "railyard::control",
            engine = %$engine,
            kind = kind.as_str(),
            $($fields)+
        );
    }};
}
pub(crate) use control_warning;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_index_their_place_in_all() {
        for (index, kind) in WarningKind::ALL.into_iter().enumerate() {
            assert_eq!(kind.index(), index);
        }
        let names: std::collections::HashSet<_> = WarningKind::ALL
            .into_iter()
            .map(WarningKind::as_str)
            .collect();
        assert_eq!(names.len(), WarningKind::ALL.len());
    }
}
