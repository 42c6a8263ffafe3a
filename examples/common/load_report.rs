//! What the gRPC load tools print (`#[path]`-included by `rls_load.rs` and
//! `grpc_proxy_load.rs`): calls/s and latency percentiles of a run, and, given the measured
//! process's PID, its CPU µs per call from /proc/PID/stat.

/// User plus system CPU ticks of process `pid`, every thread.
pub fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// Prints one line: calls, calls/s, p50/p99/p99.9 latency of `latencies_ns`, and the measured
/// process's (`who`: `server`, `proxy`) CPU µs per call between the `cpu` readings.
pub fn print(
    mut latencies_ns: Vec<u64>,
    elapsed_s: f64,
    cpu: (Option<u64>, Option<u64>),
    who: &str,
) {
    latencies_ns.sort_unstable();
    let n = latencies_ns.len();
    let pct = |p: f64| latencies_ns[((n as f64 * p) as usize).min(n - 1)] as f64 / 1e3;
    print!(
        "calls {} calls/s {:.0} p50 {:.0} µs p99 {:.0} µs p99.9 {:.0} µs",
        n,
        n as f64 / elapsed_s,
        pct(0.50),
        pct(0.99),
        pct(0.999)
    );
    if let (Some(before), Some(after)) = cpu {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let cpu_s = (after - before) as f64 / hz;
        print!(
            " {who} CPU µs/call {:.2} {who} cores busy {:.2}",
            cpu_s * 1e6 / n as f64,
            cpu_s / elapsed_s
        );
    }
    println!();
}
