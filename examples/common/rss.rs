//! The process's resident set size, shared by the memory examples (`#[path]`-included: a
//! folder without a `main.rs` is not an example of its own).

/// VmRSS of this process, in bytes (0 when /proc cannot be read).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
