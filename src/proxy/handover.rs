//! The zero-downtime upgrade's hand-over of listening sockets between two gateway processes,
//! over the Unix socket `--upgrade-sock`: the new process (started with `--upgrade`) listens
//! there, the old one (sent SIGQUIT) connects and passes its listening sockets across
//! (`SCM_RIGHTS`, with their addresses as a space-separated message, the format Pingora's own
//! hand-over uses, so an older gateway can still hand over to this one).
//!
//! Each end trusts only itself: the other end's credentials (`SO_PEERCRED`) must be this
//! process's user or root, or the connection is refused and nothing is sent or taken. The socket
//! is made owner-only, in a directory [`check_socket_dir`] trusts. The old process hands over,
//! then waits for the new one to confirm that it serves (one byte, written once every listener
//! is in place): only then does it drain and exit. When nobody takes the sockets, a stranger is
//! met, or no confirmation comes, the old process keeps serving. It says it will wait for a
//! confirmation by a first word, [`CONFIRMING`], before the addresses; a new process that was
//! promised a confirmation and cannot deliver it (the old one gave up waiting) stops rather
//! than serve beside it. (A sender from before confirmations sends only addresses and is not
//! waited for.)

use nix::sys::socket::{
    getsockopt, recvmsg, sendmsg, sockopt::PeerCredentials, ControlMessage, ControlMessageOwned,
    MsgFlags,
};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long the old process tries to reach a new one listening on the socket.
pub const CONNECT_WAIT: Duration = Duration::from_secs(10);
/// How long the old process waits, once it has handed over, for the new one to say it serves.
pub const CONFIRM_WAIT: Duration = Duration::from_secs(30);
/// How long the new process waits for the old one to hand over.
pub const RECEIVE_WAIT: Duration = Duration::from_secs(60);
/// The first word of a hand-over whose sender waits for the confirmation (never an address).
pub const CONFIRMING: &str = "tollgate-handover/confirm";
/// Most listening sockets one hand-over carries.
const MAX_SOCKETS: usize = 64;
/// Longest address list one hand-over carries.
const MAX_MESSAGE: usize = 8192;

/// Why a hand-over did not happen.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("--upgrade-sock {path}: no new gateway took the listeners within {wait:?} (start one with --upgrade first and wait for it to listen there)")]
    NoTaker { path: PathBuf, wait: Duration },
    #[error("--upgrade-sock {path}: refused the other end (uid {uid}, pid {pid}): only this user (uid {me}) or root may take part in a hand-over")]
    Stranger {
        path: PathBuf,
        uid: u32,
        pid: i32,
        me: u32,
    },
    #[error("--upgrade-sock {path}: the new gateway took the listeners but did not confirm that it serves within {wait:?}")]
    Unconfirmed { path: PathBuf, wait: Duration },
    #[error("--upgrade-sock {path}: no running gateway handed its listeners over within {wait:?} (send it SIGQUIT once this process waits)")]
    NothingReceived { path: PathBuf, wait: Duration },
    #[error("--upgrade-sock {path}: {what}")]
    Malformed { path: PathBuf, what: String },
    #[error("--upgrade-sock {path}: its directory is not trusted: {reason}")]
    UntrustedDir {
        path: PathBuf,
        reason: crate::store::fs_trust::Untrusted,
    },
    #[error("--upgrade-sock {path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
}

impl HandoverError {
    /// The metric label of the failure.
    pub fn reason(&self) -> &'static str {
        match self {
            HandoverError::NoTaker { .. } => "no_taker",
            HandoverError::Stranger { .. } => "stranger",
            HandoverError::Unconfirmed { .. } => "unconfirmed",
            HandoverError::NothingReceived { .. } => "nothing_received",
            HandoverError::Malformed { .. } => "malformed",
            HandoverError::UntrustedDir { .. } => "untrusted_dir",
            HandoverError::Io { .. } => "io",
        }
    }
}

fn io_error<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> HandoverError + 'a {
    move |source| HandoverError::Io {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// Refuses an upgrade socket whose directory another user owns or can write to (or replace):
/// whoever can put a socket there first is handed the listening sockets, or hands over its own.
///
/// # Errors
/// The reason, naming the directory.
pub fn check_socket_dir(sock: &Path, me: u32) -> Result<(), crate::store::fs_trust::Untrusted> {
    crate::store::fs_trust::check_private_dir(socket_dir(sock), me)
}

/// The directory the socket `sock` is in (`.` for a bare name).
pub fn socket_dir(sock: &Path) -> &Path {
    sock.parent()
        .filter(|dir| !dir.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// The other end of `stream`, when it is `me` or root; its `(uid, pid)` either way.
fn peer(stream: &UnixStream, me: u32) -> Result<(u32, i32), (u32, i32)> {
    match getsockopt(stream, PeerCredentials) {
        Ok(cred) if cred.uid() == me || cred.uid() == 0 => Ok((cred.uid(), cred.pid())),
        Ok(cred) => Err((cred.uid(), cred.pid())),
        // Credentials that cannot be read are nobody's: refused.
        Err(_) => Err((u32::MAX, 0)),
    }
}

/// The old process's side: connects to the new process at `path` (trying for `connect_wait`),
/// checks who it is, passes `listeners` (address, descriptor) across and waits up to
/// `confirm_wait` for the new process to say that it serves.
///
/// # Errors
/// Nobody listens there in time, the other end is not this user or root, the sending fails, or
/// no confirmation comes: in every case the caller keeps its listeners and keeps serving.
pub fn send(
    path: &Path,
    listeners: &[(String, RawFd)],
    me: u32,
    connect_wait: Duration,
    confirm_wait: Duration,
) -> Result<(), HandoverError> {
    check_socket_dir(path, me).map_err(|reason| HandoverError::UntrustedDir {
        path: path.to_path_buf(),
        reason,
    })?;
    let mut stream = connect_trusted(path, me, connect_wait)?;
    write_sockets(path, &stream, listeners, true)?;
    stream
        .set_read_timeout(Some(confirm_wait))
        .map_err(io_error(path, "cannot wait for the confirmation"))?;
    let deadline = Instant::now() + confirm_wait;
    let mut confirmation = [0u8; 1];
    loop {
        match stream.read(&mut confirmation) {
            Ok(1) => return Ok(()),
            // A signal (another SIGQUIT, a SIGHUP) interrupts the wait, not the hand-over.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted && Instant::now() < deadline => {
                continue
            }
            _ => {
                return Err(HandoverError::Unconfirmed {
                    path: path.to_path_buf(),
                    wait: confirm_wait,
                })
            }
        }
    }
}

/// Passes `listeners` to a process of this user listening at `path` that does not confirm
/// (Pingora's own bootstrap, through the upgrade's relay): the addresses only, as Pingora
/// reads them.
///
/// # Errors
/// Nobody listens there within `connect_wait`, or the sending fails.
pub fn relay(
    path: &Path,
    listeners: &[(String, RawFd)],
    me: u32,
    connect_wait: Duration,
) -> Result<(), HandoverError> {
    let stream = connect_trusted(path, me, connect_wait)?;
    write_sockets(path, &stream, listeners, false)
}

/// Connects to `path` (trying for `connect_wait`) and checks who listens there.
fn connect_trusted(
    path: &Path,
    me: u32,
    connect_wait: Duration,
) -> Result<UnixStream, HandoverError> {
    let start = Instant::now();
    let stream = loop {
        match UnixStream::connect(path) {
            Ok(stream) => break stream,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                if start.elapsed() >= connect_wait {
                    return Err(HandoverError::NoTaker {
                        path: path.to_path_buf(),
                        wait: connect_wait,
                    });
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(io_error(path, "cannot connect")(e)),
        }
    };
    if let Err((uid, pid)) = peer(&stream, me) {
        return Err(HandoverError::Stranger {
            path: path.to_path_buf(),
            uid,
            pid,
            me,
        });
    }
    Ok(stream)
}

/// Writes one hand-over message: the addresses (after [`CONFIRMING`] when `confirming`) and
/// their descriptors.
fn write_sockets(
    path: &Path,
    stream: &UnixStream,
    listeners: &[(String, RawFd)],
    confirming: bool,
) -> Result<(), HandoverError> {
    let names = listeners.iter().map(|(name, _)| name.as_str());
    let words: Vec<&str> = if confirming {
        std::iter::once(CONFIRMING).chain(names).collect()
    } else {
        names.collect()
    };
    let fds: Vec<RawFd> = listeners.iter().map(|(_, fd)| *fd).collect();
    let message = words.join(" ");
    let rights = [ControlMessage::ScmRights(&fds)];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(message.as_bytes())],
        &rights,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| io_error(path, "cannot send the listening sockets")(e.into()))?;
    Ok(())
}

/// The new process's promise to tell the old one that it serves.
pub struct Confirmation {
    stream: UnixStream,
    /// The old process waits for it (it said [`CONFIRMING`]).
    awaited: bool,
}

impl Confirmation {
    /// Tells the old process this one serves: it drains and exits.
    ///
    /// # Errors
    /// The old process waited for it and is no longer listening (it gave up and keeps
    /// serving): this process must not serve beside it. (A sender from before confirmations
    /// does not wait; a failed write to it is no error.)
    pub fn confirm(mut self) -> std::io::Result<()> {
        match self.stream.write_all(b"1") {
            Err(e) if self.awaited => Err(e),
            _ => Ok(()),
        }
    }
}

/// The new process's side: listens at `path` (owner-only), waits up to `wait` for a process of
/// `me` or root to hand its listening sockets over, and returns them by address, with the
/// [`Confirmation`] to send once they are served. Strangers who connect are refused and
/// reported through `refused` (their uid and pid); the wait goes on.
///
/// # Errors
/// The socket cannot be made, nothing arrives in time, or what arrives is malformed.
pub fn receive(
    path: &Path,
    me: u32,
    wait: Duration,
    mut refused: impl FnMut(&HandoverError),
) -> Result<(Vec<(String, OwnedFd)>, Confirmation), HandoverError> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) => {
            std::fs::remove_file(path).map_err(io_error(path, "cannot remove the old socket"))?;
        }
        Ok(_) => {
            return Err(HandoverError::Malformed {
                path: path.to_path_buf(),
                what: "something other than a socket is there; remove it".to_string(),
            })
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(io_error(path, "cannot listen"))?;
    let _remove = RemoveOnDrop(path.to_path_buf());
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(io_error(path, "cannot make the socket owner-only"))?;
    }
    listener
        .set_nonblocking(true)
        .map_err(io_error(path, "cannot listen"))?;
    let start = Instant::now();
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if start.elapsed() >= wait {
                    return Err(HandoverError::NothingReceived {
                        path: path.to_path_buf(),
                        wait,
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(io_error(path, "cannot accept")(e)),
        };
        if let Err((uid, pid)) = peer(&stream, me) {
            refused(&HandoverError::Stranger {
                path: path.to_path_buf(),
                uid,
                pid,
                me,
            });
            continue;
        }
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let (listeners, awaited) = take_sockets(path, &stream)?;
        return Ok((listeners, Confirmation { stream, awaited }));
    }
}

/// Reads one hand-over message: the addresses and their descriptors, and whether the sender
/// waits for a confirmation.
fn take_sockets(
    path: &Path,
    stream: &UnixStream,
) -> Result<(Vec<(String, OwnedFd)>, bool), HandoverError> {
    let mut message = vec![0u8; MAX_MESSAGE];
    let mut space = nix::cmsg_space!([RawFd; MAX_SOCKETS]);
    let (bytes, fds) = {
        let mut iov = [IoSliceMut::new(&mut message)];
        let received = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| io_error(path, "cannot receive the listening sockets")(e.into()))?;
        let mut fds = Vec::new();
        for cmsg in received
            .cmsgs()
            .map_err(|e| io_error(path, "cannot receive the listening sockets")(e.into()))?
        {
            if let ControlMessageOwned::ScmRights(rights) = cmsg {
                // SAFETY: descriptors the kernel just installed in this process for us; nothing
                // else owns them.
                fds.extend(
                    rights
                        .into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        (received.bytes, fds)
    };
    let mut names: Vec<String> = std::str::from_utf8(&message[..bytes])
        .map_err(|_| HandoverError::Malformed {
            path: path.to_path_buf(),
            what: "the address list is not UTF-8".to_string(),
        })?
        .split_ascii_whitespace()
        .map(str::to_string)
        .collect();
    let awaited = names.first().is_some_and(|first| first == CONFIRMING);
    if awaited {
        names.remove(0);
    }
    if names.len() != fds.len() || fds.is_empty() {
        return Err(HandoverError::Malformed {
            path: path.to_path_buf(),
            what: format!(
                "{} addresses for {} listening sockets",
                names.len(),
                fds.len()
            ),
        });
    }
    Ok((names.into_iter().zip(fds).collect(), awaited))
}

/// Removes the socket's name when the wait ends, however it ends.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn me() -> u32 {
        crate::store::fs_trust::effective_uid()
    }

    /// `send` on a thread of its own, as `uid` would, waiting 10 s for a taker and 10 s for
    /// the confirmation.
    fn send_in_background(
        path: &Path,
        listeners: Vec<(String, RawFd)>,
        uid: u32,
    ) -> std::thread::JoinHandle<Result<(), HandoverError>> {
        let path = path.to_path_buf();
        std::thread::spawn(move || {
            send(
                &path,
                &listeners,
                uid,
                Duration::from_secs(10),
                Duration::from_secs(10),
            )
        })
    }

    #[test]
    fn listening_sockets_cross_and_the_sender_waits_for_the_confirmation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrade.sock");
        let a = TcpListener::bind("127.0.0.1:0").unwrap();
        let b = TcpListener::bind("127.0.0.1:0").unwrap();
        let (a_addr, b_addr) = (a.local_addr().unwrap(), b.local_addr().unwrap());
        let receiver = {
            let path = path.clone();
            std::thread::spawn(move || receive(&path, me(), Duration::from_secs(10), |_| {}))
        };
        let sent = send_in_background(
            &path,
            vec![
                (a_addr.to_string(), a.as_raw_fd()),
                (b_addr.to_string(), b.as_raw_fd()),
            ],
            me(),
        );
        let (received, confirmation) = receiver.join().unwrap().unwrap();
        assert!(!path.exists(), "the socket's name is removed once used");
        let names: Vec<&str> = received.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, [a_addr.to_string(), b_addr.to_string()]);
        // The received descriptor is the same listening socket.
        let taken = TcpListener::from(received.into_iter().next().unwrap().1);
        assert_eq!(taken.local_addr().unwrap(), a_addr);
        assert!(!sent.is_finished(), "the sender waits for the confirmation");
        confirmation.confirm().unwrap();
        assert!(sent.join().unwrap().is_ok());
    }

    #[test]
    fn no_taker_and_no_confirmation_leave_the_sender_serving() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrade.sock");
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let listeners = [("x".to_string(), l.as_raw_fd())];
        let err = send(
            &path,
            &listeners,
            me(),
            Duration::from_millis(200),
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert_eq!(err.reason(), "no_taker");
        // A taker that closes without confirming (it failed to start).
        let receiver = {
            let path = path.clone();
            std::thread::spawn(move || receive(&path, me(), Duration::from_secs(10), |_| {}))
        };
        let sender = send_in_background(&path, listeners.to_vec(), me());
        let (_, confirmation) = receiver.join().unwrap().unwrap();
        drop(confirmation);
        assert_eq!(sender.join().unwrap().unwrap_err().reason(), "unconfirmed");

        // A confirmation that comes after the sender gave up waiting: the new process learns it
        // must not serve beside the old one.
        let receiver = {
            let path = path.clone();
            std::thread::spawn(move || receive(&path, me(), Duration::from_secs(10), |_| {}))
        };
        let impatient = {
            let path = path.clone();
            let listeners = listeners.to_vec();
            std::thread::spawn(move || {
                send(
                    &path,
                    &listeners,
                    me(),
                    Duration::from_secs(10),
                    Duration::from_millis(100),
                )
            })
        };
        let (_, confirmation) = receiver.join().unwrap().unwrap();
        assert_eq!(
            impatient.join().unwrap().unwrap_err().reason(),
            "unconfirmed"
        );
        assert!(confirmation.confirm().is_err());
    }

    #[test]
    fn a_sender_that_does_not_wait_is_not_confirmed_to() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrade.sock");
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let receiver = {
            let path = path.clone();
            std::thread::spawn(move || receive(&path, me(), Duration::from_secs(10), |_| {}))
        };
        relay(
            &path,
            &[("127.0.0.1:1".to_string(), l.as_raw_fd())],
            me(),
            Duration::from_secs(10),
        )
        .unwrap();
        let (received, confirmation) = receiver.join().unwrap().unwrap();
        assert_eq!(received[0].0, "127.0.0.1:1");
        // Its end is gone: no error, no stop.
        assert!(confirmation.confirm().is_ok());
    }

    /// A child process killed when the value goes, however a test ends.
    struct KillOnDrop(std::process::Child);

    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// Runs `python3 -c script` as nobody (uid 65534); `None` when not root.
    fn as_nobody(script: &str) -> Option<std::process::Child> {
        if me() != 0 {
            eprintln!("not root: the other-user half of this test is skipped");
            return None;
        }
        Some(
            std::process::Command::new("setpriv")
                .args([
                    "--reuid=65534",
                    "--regid=65534",
                    "--clear-groups",
                    "/usr/bin/python3",
                    "-c",
                    script,
                ])
                .spawn()
                .unwrap(),
        )
    }

    #[test]
    fn a_stranger_is_neither_handed_the_sockets_nor_believed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let path = dir.path().join("upgrade.sock");
        // Another user listens where the new gateway should: nothing is sent to them.
        let script = format!(
            "import socket,time\ns=socket.socket(socket.AF_UNIX)\ns.bind({:?})\ns.listen(1)\nc,_=s.accept()\ntime.sleep(2)\n",
            path.display().to_string()
        );
        let Some(stranger) = as_nobody(&script) else {
            return;
        };
        // Killed however the test ends (it holds the test harness's inherited descriptors).
        let stranger = KillOnDrop(stranger);
        let start = Instant::now();
        while !path.exists() {
            assert!(start.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(20));
        }
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        // `send` does not even try in a directory others can write to...
        let err = send(
            &path,
            &[("x".to_string(), l.as_raw_fd())],
            0,
            Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .unwrap_err();
        assert_eq!(err.reason(), "untrusted_dir");
        // ...and behind that check, the other end's credentials refuse the stranger.
        let err = connect_trusted(&path, 0, Duration::from_secs(5)).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "--upgrade-sock {}: refused the other end (uid 65534, pid {}): only this user (uid 0) or root may take part in a hand-over",
                path.display(),
                stranger.0.id()
            )
        );
        drop(stranger);
        std::fs::remove_file(&path).unwrap();

        // Another user connects first to the waiting new gateway (the socket's mode would stop
        // them; this checks the credentials behind it): refused, and the real one then arrives.
        let receiver = {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let got = receive(&path, 0, Duration::from_secs(20), |e| seen.push(e.reason()));
                (got, seen)
            })
        };
        // Once the receiver has made its socket owner-only, opened to everyone for this test.
        while std::fs::metadata(&path).map_or(true, |m| m.permissions().mode() & 0o777 != 0o600) {
            assert!(start.elapsed() < Duration::from_secs(20));
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let script = format!(
            "import socket,array\ns=socket.socket(socket.AF_UNIX)\ns.connect({:?})\nl=socket.socket()\nl.bind(('127.0.0.1',0))\nl.listen()\ns.sendmsg([b'127.0.0.1:1'],[(socket.SOL_SOCKET,socket.SCM_RIGHTS,array.array('i',[l.fileno()]))])\n",
            path.display().to_string()
        );
        let status = as_nobody(&script).unwrap().wait().unwrap();
        assert!(status.success());
        // The directory owner-only again, as the real sender requires.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let real = TcpListener::bind("127.0.0.1:0").unwrap();
        let real_addr = real.local_addr().unwrap().to_string();
        let sender = send_in_background(&path, vec![(real_addr.clone(), real.as_raw_fd())], 0);
        let (got, seen) = receiver.join().unwrap();
        let (received, confirmation) = got.unwrap();
        assert_eq!(seen, ["stranger"]);
        assert_eq!(received.len(), 1);
        assert_eq!(received[0].0, real_addr);
        confirmation.confirm().unwrap();
        assert!(sender.join().unwrap().is_ok());
    }
}
