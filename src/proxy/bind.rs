//! Binding every listening socket before Pingora starts, so start-up either serves or fails.
//!
//! Left to itself, Pingora binds each listener inside its service, on the service's own
//! runtime, after the process has started serving elsewhere: an address in use is retried once
//! a second for 30 s (`... is in use, will try again`), then the service thread panics while
//! the rest of the process (the admin listener and its `/readyz`) runs on. So tollgate binds
//! every address itself first, here, with the socket options Pingora would set (`SO_REUSEADDR`,
//! a backlog of 65 535, `IPV6_V6ONLY` left at the system's default, close-on-exec,
//! non-blocking), and puts the sockets in Pingora's table of listening sockets, the same table an
//! upgrade fills with the sockets it is handed. A listening service finds its address there and
//! takes that socket instead of binding, so Pingora never binds a TCP socket of ours, and there
//! is no window between a check and the real bind in which another process could take a port.
//!
//! A failure is one error naming the flag, the address and the operating system's reason
//! ([`BindError`]); `tollgate run` logs it once and exits 1 before anything is served. With
//! `--bind-retry` an address in use is tried again once a second, up to 30 times (Pingora's own
//! schedule), before failing the same way. The admin listener is bound last, so `/readyz` cannot
//! even be reached before every other listener is bound.
//!
//! On an upgrade the sockets the running gateway hands over are used as they are; only an
//! address this process adds (one the old process did not listen on) is bound here, after the
//! hand-over and before this process confirms that it serves: when it cannot be bound, this
//! process exits 1 and the old one keeps serving on its sockets.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::OwnedFd;
use std::time::Duration;

/// Pingora's listen backlog (`LISTENER_BACKLOG` in its `listeners/l4.rs`); the kernel caps it at
/// `net.core.somaxconn`.
const BACKLOG: i32 = 65_535;

/// How `--bind-retry` retries an address in use: Pingora's schedule.
pub const RETRY_TRIES: u32 = 30;
/// The pause between two tries of `--bind-retry`.
pub const RETRY_STEP: Duration = Duration::from_secs(1);

/// One address to listen on, with the flag that asked for it (named in errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// The address as configured: also the socket's key in Pingora's table.
    pub addr: String,
    /// `--listen`, `--listen-tls`, `--admin-listen`, `--grpc-listen`.
    pub flag: &'static str,
}

/// A listener that cannot be bound.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {addr}: cannot listen: {source}")]
pub struct BindError {
    pub flag: &'static str,
    pub addr: String,
    pub source: std::io::Error,
}

/// What to do with an address in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Fail at once (the default).
    Never,
    /// Try up to this many times in all, pausing between tries (`--bind-retry`).
    InUse { tries: u32, step: Duration },
}

impl Retry {
    /// `--bind-retry` on or off.
    pub fn from_flag(bind_retry: bool) -> Retry {
        if bind_retry {
            Retry::InUse {
                tries: RETRY_TRIES,
                step: RETRY_STEP,
            }
        } else {
            Retry::Never
        }
    }
}

/// Binds every address of `wanted`, in order (put the admin listener last), each as Pingora
/// would. `pause` is called between two tries of an address in use (the real one sleeps).
///
/// # Errors
/// The first address that cannot be bound (with [`Retry::InUse`]: one still in use after the
/// last try); the sockets bound before it are closed.
pub fn bind_all(
    wanted: &[Wanted],
    retry: Retry,
    mut pause: impl FnMut(Duration),
) -> Result<Vec<(String, OwnedFd)>, BindError> {
    let mut bound = Vec::with_capacity(wanted.len());
    for want in wanted {
        let listener = bind_retrying(want, retry, &mut pause)?;
        bound.push((want.addr.clone(), OwnedFd::from(listener)));
    }
    Ok(bound)
}

fn bind_retrying(
    want: &Wanted,
    retry: Retry,
    pause: &mut impl FnMut(Duration),
) -> Result<TcpListener, BindError> {
    let mut tried = 0u32;
    loop {
        tried += 1;
        match bind_one(&want.addr) {
            Ok(listener) => return Ok(listener),
            Err(e) => match retry {
                Retry::InUse { tries, step }
                    if e.kind() == std::io::ErrorKind::AddrInUse && tried < tries =>
                {
                    tracing::warn!(
                        "{} {}: in use, will try again in {step:?} (--bind-retry, try {tried} of {tries})",
                        want.flag,
                        want.addr
                    );
                    pause(step);
                }
                _ => {
                    return Err(BindError {
                        flag: want.flag,
                        addr: want.addr.clone(),
                        source: e,
                    })
                }
            },
        }
    }
}

/// One listening socket on `addr` (an `IP:PORT`, checked by the configuration), made as
/// Pingora's `bind_tcp` makes it.
fn bind_one(addr: &str) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let addr: SocketAddr = addr.parse().map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "expected IP:PORT such as 0.0.0.0:8080 or [::]:8080",
        )
    })?;
    // socket2 opens it close-on-exec, so a child process never inherits a listener.
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    // Pingora's and tonic's accept loops expect a non-blocking socket.
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted(addr: &str, flag: &'static str) -> Wanted {
        Wanted {
            addr: addr.to_string(),
            flag,
        }
    }

    #[test]
    fn an_address_in_use_is_one_error_naming_flag_address_and_reason() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let free = TcpListener::bind("127.0.0.1:0").unwrap();
        let free_addr = free.local_addr().unwrap().to_string();
        drop(free);
        let mut pauses = 0;
        let err = bind_all(
            &[
                wanted(&free_addr, "--listen"),
                wanted(&addr, "--admin-listen"),
            ],
            Retry::Never,
            |_| pauses += 1,
        )
        .unwrap_err();
        assert_eq!(pauses, 0);
        assert_eq!(err.source.kind(), std::io::ErrorKind::AddrInUse);
        assert_eq!(
            err.to_string(),
            format!("--admin-listen {addr}: cannot listen: Address already in use (os error 98)")
        );
        // The listener bound before the failure was closed with it.
        assert!(TcpListener::bind(&free_addr).is_ok());
    }

    #[test]
    fn a_bound_listener_accepts_and_is_nonblocking() {
        let free = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = free.local_addr().unwrap().to_string();
        drop(free);
        let mut bound = bind_all(&[wanted(&addr, "--listen")], Retry::Never, |_| {}).unwrap();
        assert_eq!(bound.len(), 1);
        let (key, fd) = bound.remove(0);
        assert_eq!(key, addr);
        let listener = TcpListener::from(fd);
        let _client = std::net::TcpStream::connect(&addr).unwrap();
        // Non-blocking: accept returns the queued connection, then WouldBlock, never waits.
        assert!(listener.accept().is_ok());
        assert_eq!(
            listener.accept().unwrap_err().kind(),
            std::io::ErrorKind::WouldBlock
        );
    }

    #[test]
    fn bind_retry_tries_again_until_the_address_is_free() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let mut holder = Some(taken);
        let mut pauses = Vec::new();
        // The "pause" frees the address after the second try: no real time passes.
        let bound = bind_all(
            &[wanted(&addr, "--listen")],
            Retry::InUse {
                tries: 5,
                step: Duration::from_secs(1),
            },
            |step| {
                pauses.push(step);
                if pauses.len() == 2 {
                    holder = None;
                }
            },
        )
        .unwrap();
        assert_eq!(pauses, [Duration::from_secs(1); 2]);
        assert_eq!(bound.len(), 1);
    }

    #[test]
    fn bind_retry_gives_up_after_its_tries() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let mut pauses = 0;
        let err = bind_all(
            &[wanted(&addr, "--grpc-listen")],
            Retry::InUse {
                tries: 3,
                step: Duration::from_millis(1),
            },
            |_| pauses += 1,
        )
        .unwrap_err();
        assert_eq!(pauses, 2);
        assert_eq!(err.source.kind(), std::io::ErrorKind::AddrInUse);
    }

    #[test]
    fn other_errors_are_not_retried() {
        let mut pauses = 0;
        // An address this machine does not have: EADDRNOTAVAIL, not worth waiting for.
        let err = bind_all(
            &[wanted("192.0.2.1:8080", "--listen")],
            Retry::from_flag(true),
            |_| pauses += 1,
        )
        .unwrap_err();
        assert_eq!(pauses, 0);
        assert_eq!(err.source.kind(), std::io::ErrorKind::AddrNotAvailable);
        assert_eq!(
            err.to_string(),
            "--listen 192.0.2.1:8080: cannot listen: Cannot assign requested address (os error 99)"
        );
    }
}
