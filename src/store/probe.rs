//! Linear probing's one rule both open-addressed tables of the embedded store follow when an
//! entry is deleted (backward shift): the bucket table ([`super::memory`]) and the lease table
//! ([`super::lease`]).

/// Whether `home` lies cyclically in `(hole, j]`: the entry at `j` must then stay after the
/// hole (moving it before its home would hide it from probes).
pub(super) fn stays(home: usize, hole: usize, j: usize) -> bool {
    if hole <= j {
        hole < home && home <= j
    } else {
        hole < home || home <= j
    }
}
